"""The batched entry points are bit-identical to the one-call-per-matrix forms they
replace: matmul_many = one matmul per weight, apply_experts = apply_experts_each (one
expert_swiglu per expert, gated and scattered), rank_sum = rank_sum_each. Every ISA on
this CPU, both families, 1 and 2 threads; bad arguments raise ValueError, never crash."""

from __future__ import annotations

import types

import numpy as np
import pytest

from colibrid.backends.base import ExpertBatch, KernelFamily, ResidentExperts, RouteRule
from colibrid.backends.moe_plan import moe_each
from colibrid.formats.weights import WeightFormat
from colibrid.models.base import apply_experts_each, rank_sum_each

cpu = pytest.importorskip("colibrid.backends.cpu")

FAMILIES = [KernelFamily.F32, KernelFamily.I8]
Q4 = WeightFormat.Q4
Q8 = WeightFormat.Q8
F32 = WeightFormat.F32
BF16 = WeightFormat.BF16


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    assert got.dtype == np.float32 and want.dtype == np.float32, what
    assert got.shape == want.shape, what
    np.testing.assert_array_equal(bits(got), bits(want), err_msg=what)


def setup(kit, isa: str, nthreads: int) -> None:
    kit.isa_or_skip(isa)
    kit.native.set_isa(isa)
    kit.native.set_threads(nthreads)


# ---- matmul_many ------------------------------------------------------------------

# (I, [(fmt, group size, O), ...]): same layouts (the prepared activation is reused,
# also by a later weight that is not adjacent), all different, and an I that is not a
# multiple of the group size.
MANY_SETS = {
    "one": (256, [(Q4, 64, 48)]),
    "q4g64-same": (256, [(Q4, 64, 40), (Q4, 64, 96), (Q4, 64, 7)]),
    "mixed": (
        256,
        [
            (Q4, 64, 64),
            (Q8, 0, 33),
            (Q4, 64, 100),
            (F32, 0, 17),
            (BF16, 0, 50),
            (Q4, 32, 80),
            (Q8, 0, 5),
            (BF16, 0, 9),
            (Q4, 32, 3),
            (F32, 0, 70),
        ],
    ),
    "all-different": (192, [(Q4, 32, 24), (Q4, 64, 65), (Q8, 0, 31), (F32, 0, 16), (BF16, 0, 8)]),
    "ragged-i": (100, [(Q4, 64, 30), (Q4, 32, 41), (Q8, 0, 12), (Q4, 64, 9), (Q4, 0, 20)]),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("s", [1, 5, 40])
@pytest.mark.parametrize("name", list(MANY_SETS))
def test_matmul_many_equals_matmuls(kit, isa, family, nthreads, s, name):
    setup(kit, isa, nthreads)
    i, specs = MANY_SETS[name]
    weights = [kit.make_weight(f, o, i, gs, seed=100 + k) for k, (f, gs, o) in enumerate(specs)]
    x = np.random.default_rng(s).standard_normal((s, i), dtype=np.float32)
    x0 = x.copy()
    got = kit.native.matmul_many(weights, x, family)
    assert isinstance(got, list) and len(got) == len(weights)
    assert_bits_equal(x, x0, "x was modified")
    for k, (w, y) in enumerate(zip(weights, got, strict=True)):
        want = kit.native.matmul(w, x, family)
        assert_bits_equal(y, want, f"{name} weight {k} {w.fmt.value} g{w.group_size} {w.shape}")
    again = cpu.CpuOps().matmul_many(weights, x, family)
    for y, z in zip(got, again, strict=True):
        assert_bits_equal(z, y, "CpuOps.matmul_many")


def test_matmul_many_rejects_bad_input(kit):
    w1 = kit.make_weight(Q4, 16, 128, 64, seed=1)
    w2 = kit.make_weight(Q8, 8, 64, 0, seed=2)
    x = np.ones((2, 128), np.float32)
    fam = KernelFamily.I8
    with pytest.raises(ValueError, match="at least one"):
        kit.native.matmul_many([], x, fam)
    with pytest.raises(ValueError, match="disagree on I"):
        kit.native.matmul_many([w1, w2], x, fam)
    with pytest.raises(ValueError, match="shape"):
        kit.native.matmul_many([w1], np.ones((2, 64), np.float32), fam)
    with pytest.raises(ValueError, match="float32"):
        kit.native.matmul_many([w1], np.ones((2, 128), np.float64), fam)


# ---- apply_experts ----------------------------------------------------------------


def expert(kit, d: int, f: int, specs, seed: int) -> types.SimpleNamespace:
    """gate/up [f, d] and down [d, f]; specs = ((fmt, gs) of gate, of up, of down)."""
    (gf, gg), (uf, ug), (df, dg) = specs
    return types.SimpleNamespace(
        gate=kit.make_weight(gf, f, d, gg, seed=seed),
        up=kit.make_weight(uf, f, d, ug, seed=seed + 1),
        down=kit.make_weight(df, d, f, dg, seed=seed + 2),
    )


Q4G64 = ((Q4, 64),) * 3
Q8ALL = ((Q8, 0),) * 3

# name -> (D, routed experts' (F, specs), shared expert's (F, specs), where the shared
# expert sits in the list, routed experts that get no pairs, shuffle pairs per expert)
EXPERT_SETS = {
    "q4g64": (128, [(192, Q4G64)] * 6, (192, Q4G64), "last", {2}, False),
    "q8": (128, [(128, Q8ALL)] * 6, (128, Q8ALL), "first", {0, 5}, False),
    "wide-shared": (128, [(128, Q4G64)] * 6, (320, Q4G64), "middle", {4}, True),
    "mixed": (
        128,
        [
            (128, ((Q4, 64), (Q4, 64), (Q8, 0))),
            (128, Q8ALL),
            (64, ((BF16, 0), (BF16, 0), (F32, 0))),
            (128, ((F32, 0), (Q4, 32), (BF16, 0))),
            (192, ((Q4, 32), (Q4, 32), (Q4, 64))),
            (128, ((Q8, 0), (Q4, 64), (Q4, 32))),
        ],
        (256, ((Q4, 64), (Q8, 0), (Q4, 32))),
        "last",
        {1},
        True,
    ),
}


def build_case(kit, name: str, s: int, k: int, seed: int):
    """Experts, an ExpertBatch routing s rows to k distinct routed experts each plus the
    shared expert on every row, x [s, D] and the output row count."""
    d, routed_specs, (shared_f, shared_specs), where, empty, shuffle = EXPERT_SETS[name]
    rng = np.random.default_rng(seed)
    routed = [expert(kit, d, f, sp, seed=10 * e) for e, (f, sp) in enumerate(routed_specs)]
    shared = expert(kit, d, shared_f, shared_specs, seed=999)
    pos = {"first": 0, "middle": len(routed) // 2, "last": len(routed)}[where]
    weights = routed[:pos] + [shared] + routed[pos:]
    index = [e if e < pos else e + 1 for e in range(len(routed))]  # routed -> list index
    per: list[list[tuple[int, float, int]]] = [[] for _ in weights]
    candidates = [e for e in range(len(routed)) if e not in empty]
    for row in range(s):
        chosen = rng.choice(candidates, size=k, replace=False)
        for rank, e in enumerate(chosen):
            per[index[int(e)]].append((row, float(rng.uniform(0.05, 1.5)), row * (k + 1) + rank))
    if shuffle:
        for e in range(len(routed)):
            rng.shuffle(per[index[e]])
    per[pos] = [(row, 1.0, row * (k + 1) + k) for row in range(s)]
    start, rows, gates, dest = [0], [], [], []
    for pairs in per:
        for row, g, dst in pairs:
            rows.append(row)
            gates.append(g)
            dest.append(dst)
        start.append(len(rows))
    for e in empty:
        assert start[index[e] + 1] == start[index[e]]
    batch = ExpertBatch(weights, start, rows, gates, dest)
    x = (rng.standard_normal((s, d)) * 2).astype(np.float32)
    return batch, x, s * (k + 1) + 3  # three output rows nobody writes


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("s,k", [(1, 2), (1, 4), (3, 4), (17, 2), (17, 3)])
@pytest.mark.parametrize("name", list(EXPERT_SETS))
def test_apply_experts_equals_each(kit, isa, family, nthreads, s, k, name):
    setup(kit, isa, nthreads)
    batch, x, r = build_case(kit, name, s, k, seed=s * 10 + k)
    d = x.shape[1]
    init = np.random.default_rng(7).standard_normal((r, d), dtype=np.float32)
    want = init.copy()
    apply_experts_each(cpu.CpuOps(), batch, x, want, family)
    got = init.copy()
    x0 = x.copy()
    kit.native.apply_experts(
        batch.weights, batch.start, batch.rows, batch.gates, batch.dest, x, got, family
    )
    assert_bits_equal(x, x0, "x was modified")
    for e in range(len(batch.weights)):
        for p in range(batch.start[e], batch.start[e + 1]):
            dst = batch.dest[p]
            assert_bits_equal(got[dst], want[dst], f"{name}: expert {e} pair {p} -> row {dst}")
    assert_bits_equal(got, want, f"{name}: full out")
    assert_bits_equal(got[-3:], init[-3:], "unwritten rows changed")
    via_ops = init.copy()
    cpu.CpuOps().apply_experts(batch, x, via_ops, family)
    assert_bits_equal(via_ops, want, "CpuOps.apply_experts")


@pytest.mark.parametrize("family", FAMILIES)
def test_apply_experts_repeat_and_thread_independent(kit, isa, family):
    """The same call twice (the work arenas are reused) and under 1 vs 2 threads."""
    kit.isa_or_skip(isa)
    kit.native.set_isa(isa)
    batch, x, r = build_case(kit, "mixed", 17, 3, seed=3)
    outs = []
    for nt in (2, 1, 2):
        kit.native.set_threads(nt)
        out = np.zeros((r, x.shape[1]), np.float32)
        cpu.CpuOps().apply_experts(batch, x, out, family)
        outs.append(out)
    assert_bits_equal(outs[1], outs[0], "1 vs 2 threads")
    assert_bits_equal(outs[2], outs[0], "repeat")


def test_apply_experts_nothing_to_do(kit):
    batch, x, r = build_case(kit, "q4g64", 3, 2, seed=1)
    out = np.random.default_rng(0).standard_normal((r, x.shape[1]), dtype=np.float32)
    keep = out.copy()
    n = len(batch.weights)
    fam = KernelFamily.I8
    kit.native.apply_experts(batch.weights, [0] * (n + 1), [], [], [], x, out, fam)
    kit.native.apply_experts([], [0], [], [], [], x, out, fam)
    assert_bits_equal(out, keep, "an empty batch wrote")


def test_apply_experts_rejects_bad_input(kit):
    fam = KernelFamily.I8
    batch, x, r = build_case(kit, "q4g64", 3, 2, seed=2)
    w, start, rows, gates, dest = batch.weights, batch.start, batch.rows, batch.gates, batch.dest
    d = x.shape[1]
    out = np.random.default_rng(1).standard_normal((r, d), dtype=np.float32)
    keep = out.copy()
    e0 = next(e for e in range(len(w)) if start[e + 1] > start[e])  # an expert with pairs
    p0 = start[e0]
    assert start[2] < len(rows)  # so start[1] = len(rows) makes start decrease

    def call(**kw):
        a = dict(weights=w, start=start, rows=rows, gates=gates, dest=dest, x=x, out=out)
        a.update(kw)
        kit.native.apply_experts(**a, family=fam)

    def changed(lst, p, v):
        c = list(lst)
        c[p] = v
        return c

    cases = [
        ("start end", dict(start=start[:-1] + [len(rows) - 1]), "start"),
        ("start past end", dict(start=start[:-1] + [len(rows) + 1]), "start"),
        ("start[0]", dict(start=[1] + start[1:]), "start"),
        ("start length", dict(start=start + [len(rows)]), "start"),
        # decreasing, but never past len(rows): a start[e] beyond it is read past the
        # end of rows/dest by the C check before the decrease is seen (see batch.c)
        ("start decreasing", dict(start=changed(start, 1, len(rows))), None),
        ("gates length", dict(gates=gates[:-1]), "gates"),
        ("dest length", dict(dest=dest + [0]), "dest"),
        ("row == S", dict(rows=changed(rows, p0, x.shape[0])), None),
        ("row < 0", dict(rows=changed(rows, p0, -1)), None),
        ("row far", dict(rows=changed(rows, len(rows) - 1, 10**6)), None),
        ("dest == R", dict(dest=changed(dest, p0, r)), None),
        ("dest < 0", dict(dest=changed(dest, len(dest) - 1, -1)), None),
        ("x width", dict(x=np.ones((x.shape[0], d + 64), np.float32)), None),
        ("x 1-D", dict(x=np.ascontiguousarray(x[0])), "2-D"),
        ("x float64", dict(x=x.astype(np.float64)), "float32"),
        ("x strided", dict(x=np.ones((x.shape[0], 2 * d), np.float32)[:, ::2]), "contiguous"),
        ("out float64", dict(out=out.astype(np.float64)), "float32"),
        ("out width", dict(out=np.zeros((r, d + 1), np.float32)), "shape"),
        ("out 1-D", dict(out=np.zeros(r * d, np.float32)), "2-D"),
        ("out strided", dict(out=np.zeros((r, 2 * d), np.float32)[:, ::2]), "contiguous"),
    ]
    ro = out.copy()
    ro.flags.writeable = False
    cases.append(("out read-only", dict(out=ro), "writ"))
    g = w[e0]
    f, dd = g.gate.shape
    bad = [
        (
            "down [D, F']",
            types.SimpleNamespace(
                gate=g.gate, up=g.up, down=kit.make_weight(Q4, dd, f + 64, 64, seed=5)
            ),
        ),
        (
            "down [F, D]",
            types.SimpleNamespace(
                gate=g.gate, up=g.up, down=kit.make_weight(Q4, f, dd, 64, seed=5)
            ),
        ),
        (
            "up [F', D]",
            types.SimpleNamespace(
                gate=g.gate, up=kit.make_weight(Q4, f + 2, dd, 64, seed=6), down=g.down
            ),
        ),
        (
            "gate [F, D']",
            types.SimpleNamespace(
                gate=kit.make_weight(Q4, f, dd + 64, 64, seed=7), up=g.up, down=g.down
            ),
        ),
    ]
    for what, ex in bad:
        cases.append((what, dict(weights=w[:e0] + [ex] + w[e0 + 1 :]), None))
    cases.append(
        (
            "not a weight",
            dict(
                weights=w[:e0]
                + [types.SimpleNamespace(gate=g.gate.data, up=g.up, down=g.down)]
                + w[e0 + 1 :]
            ),
            "QuantWeight",
        )
    )
    for what, kw, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            call(**kw)
        assert str(info.value), what
        assert_bits_equal(out, keep, f"{what}: out written before the error")
    call()  # the unmodified call still works afterwards
    want = keep.copy()
    apply_experts_each(cpu.CpuOps(), batch, x, want, fam)
    assert_bits_equal(out, want, "after the rejected calls")


# ---- rank_sum ---------------------------------------------------------------------


def awkward(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """float32 spanning subnormals to ~1e38, with +-0.0, exact cancellations and a few
    infinities, so a different order or flush-to-zero would show in the bits."""
    mag = 10.0 ** rng.uniform(-44, 38, shape)
    a = (np.where(rng.random(shape) < 0.5, -1.0, 1.0) * mag).astype(np.float32)
    normal = rng.random(shape) < 0.3  # some ordinary magnitudes too
    a[normal] = rng.standard_normal(shape).astype(np.float32)[normal]
    a.flat[rng.random(a.size) < 0.1] = -0.0
    a.flat[rng.random(a.size) < 0.05] = 0.0
    a.flat[rng.random(a.size) < 0.01] = np.inf
    a.flat[rng.random(a.size) < 0.01] = -np.inf
    if len(shape) == 3 and shape[1] > 1:
        a[:, 1] = -a[:, 0]  # exact cancellation: x + -x = +0.0
    return a


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 8, 96), (3, 5, 7), (17, 9, 257), (40, 2, 64)])
def test_rank_sum_equals_each(kit, isa, shape):
    kit.isa_or_skip(isa)
    kit.native.set_isa(isa)
    rng = np.random.default_rng(sum(shape))
    for parts in (
        awkward(rng, shape),
        rng.standard_normal(shape, dtype=np.float32),
        np.full(shape, -0.0, np.float32),
        (rng.standard_normal(shape) * 1e-40).astype(np.float32),  # subnormal only
    ):
        p0 = parts.copy()
        got = kit.native.rank_sum(parts)
        with np.errstate(invalid="ignore", over="ignore"):  # inf + -inf: NaN is fine
            want = rank_sum_each(parts)
        assert_bits_equal(got, want, f"rank_sum {shape}")
        assert_bits_equal(cpu.CpuOps().rank_sum(parts), got, "CpuOps.rank_sum")
        assert_bits_equal(parts, p0, "parts was modified")


def test_rank_sum_of_negative_zeros_is_positive_zero(kit):
    got = kit.native.rank_sum(np.full((2, 3, 4), -0.0, np.float32))
    assert (bits(got) == 0).all()


def test_rank_sum_rejects_bad_input(kit):
    ok = np.ones((2, 3, 4), np.float32)
    for what, parts, match in [
        ("2-D", np.ones((2, 4), np.float32), "3-D"),
        ("list", ok.tolist(), "3-D"),
        ("float64", ok.astype(np.float64), "float32"),
        ("strided", np.ones((2, 3, 8), np.float32)[:, :, ::2], "contiguous"),
        ("no rows", np.ones((0, 3, 4), np.float32), "non-empty"),
        ("no ranks", np.ones((2, 0, 4), np.float32), "non-empty"),
        ("no width", np.ones((2, 3, 0), np.float32), "non-empty"),
    ]:
        with pytest.raises(ValueError, match=match):
            kit.native.rank_sum(parts)
        assert what


# ---- moe: the resident layer in one call --------------------------------------------

# (routed experts, rule, selection bias, shared expert): GLM/DeepSeek's grouped sigmoid
# routing with a bias and a shared expert; softmax routing with no shared expert; a top-k
# as large as the expert count (every expert chosen by every row)
MOE_SETS = {
    "grouped-sigmoid": (16, RouteRule(4, 4, 2, True, 2.5), True, True),
    "softmax": (8, RouteRule(2, softmax=True), False, False),
    "every-expert": (4, RouteRule(4, norm=False), False, True),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("s", [1, 3, 17])
@pytest.mark.parametrize("name", list(MOE_SETS))
def test_moe_equals_route_experts_and_rank_sum(kit, isa, family, nthreads, s, name):
    """colibri_moe gives the ids and the bits of the three calls the MoE block makes for
    a layer whose experts stream (moe_each on the same backend)."""
    setup(kit, isa, nthreads)
    n, rule, biased, with_shared = MOE_SETS[name]
    d, f = 128, 192
    layer = ResidentExperts([expert(kit, d, f, Q4G64, seed=10 * k) for k in range(n)])
    shared = expert(kit, d, 256, ((Q8, 0), (Q4, 64), (Q4, 32)), seed=7) if with_shared else None
    rng = np.random.default_rng(s)
    weight = rng.standard_normal((n, d), dtype=np.float32) * np.float32(0.3)
    bias = rng.uniform(-0.2, 0.2, n).astype(np.float32) if biased else None
    x = rng.standard_normal((s, d), dtype=np.float32)
    ops = cpu.CpuOps()
    ids, out = ops.moe(x, weight, bias, rule, layer, shared, family)
    want_ids, want = moe_each(ops, x, weight, bias, rule, layer, shared, family)
    assert np.array_equal(ids, want_ids)
    assert_bits_equal(out, want, name)


def test_moe_rejects_bad_input(kit):
    d, f, n = 64, 64, 4
    layer = ResidentExperts([expert(kit, d, f, Q4G64, seed=k) for k in range(n)])
    weight = np.ones((n, d), np.float32)
    x = np.ones((1, d), np.float32)
    fam = KernelFamily.F32
    with pytest.raises(ValueError, match="weight"):
        kit.native.moe(x, np.ones((n + 1, d), np.float32), None, RouteRule(2), layer, None, fam)
    with pytest.raises(ValueError, match="top_k"):
        kit.native.moe(x, weight, None, RouteRule(n + 1), layer, None, fam)
    with pytest.raises(ValueError, match="float32"):
        kit.native.moe(x.astype(np.float64), weight, None, RouteRule(2), layer, None, fam)
    with pytest.raises(ValueError, match="rejected"):  # 4 experts do not split in 3 groups
        kit.native.moe(x, weight, None, RouteRule(2, 3, 1), layer, None, fam)
