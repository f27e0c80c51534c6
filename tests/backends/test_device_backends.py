"""Every device backend below its ops (cuda on its CPU emulation, cuda on an NVIDIA GPU
where there is one, webgpu on any WebGPU adapter: Mesa's lavapipe in CI): the device tier
keeps its copies within its budget, drops a copy when its weight goes and never changes a
result by what it holds; rows are computed alone; products dispatched together give the
bits of each alone; in the I8 family every product and every expert gives the CPU
kernels' bits wherever it is computed (kept on the device, copied for one op, or computed
on the host beside it), up to the whole model streamed through a small tier."""

from __future__ import annotations

import gc
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest

from colibrid.backends import cuda, webgpu
from colibrid.backends.base import ExpertBatch, KernelFamily
from colibrid.backends.cpu import CpuOps
from colibrid.backends.cuda import CudaOps
from colibrid.backends.cuda_device import EmulatedDevice, open_gpu
from colibrid.backends.webgpu import WebgpuOps
from colibrid.backends.webgpu_device import GpuDevice, open_device
from colibrid.engine.engine import Engine
from colibrid.errors import BackendError
from colibrid.formats.quant import container_tensors, dequantize, quantize
from colibrid.formats.weights import QuantWeight, WeightFormat
from colibrid.models.base import apply_experts_each
from colibrid.store.options import StoreOptions

F32 = KernelFamily.F32
I8 = KernelFamily.I8


class Backend:
    """One device backend: ``make(vram_bytes=, host_experts=)`` its ops on one device,
    ``exact`` its rule for the weights it computes in I8."""

    def __init__(self, make: Callable[..., object], exact: Callable[[QuantWeight], bool]) -> None:
        self.make = make
        self.exact = exact


@pytest.fixture(
    scope="module",
    params=["cuda-emulated", "cuda-gpu", "webgpu", "webgpu-other-layout", "webgpu-portable"],
)
def device(request) -> Backend:  # noqa: ANN001
    """The device backends this machine has: the cuda kernels' CPU emulation everywhere,
    GPU 0 through pycuda where there is one, the WebGPU adapter where there is one (with
    its own kernel layout and the other one, and its integer dots by the portable shader
    rather than the builtin)."""
    try:
        if request.param == "cuda-emulated":
            gpu = EmulatedDevice()
        elif request.param == "cuda-gpu":
            gpu = open_gpu()
        else:
            own = open_device()
            adapter = {
                "webgpu": own,
                "webgpu-other-layout": GpuDevice(cooperative=not own.cooperative),
                "webgpu-portable": GpuDevice(portable_dot4=True),
            }[request.param]
            return Backend(lambda **kw: WebgpuOps(adapter, **kw), webgpu.exact_on_device)
    except BackendError as exc:
        pytest.skip(str(exc))
    return Backend(lambda **kw: CudaOps(gpu, **kw), cuda.exact_on_device)


def _weight(o: int, i: int, seed: int) -> QuantWeight:
    w = np.random.default_rng(seed).standard_normal((o, i), dtype=np.float32)
    return quantize(w, WeightFormat.Q4, 64)


def test_the_tier_keeps_to_its_budget_and_never_changes_a_result(device) -> None:  # noqa: ANN001
    weights = [_weight(48, 128, seed) for seed in range(6)]
    x = np.random.default_rng(9).standard_normal((3, 128), dtype=np.float32)
    roomy = device.make(vram_bytes=1 << 30)
    one_fits = device.make(vram_bytes=weights[0].nbytes + 64)
    want = [roomy.matmul(w, x, F32) for w in weights]
    for _ in range(2):  # the second pass re-copies what the small tier evicted
        got = [one_fits.matmul(w, x, F32) for w in weights]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    small, big = one_fits.tier.stats, roomy.tier.stats
    assert small.weights == 1 and small.bytes <= small.budget
    assert small.copies == 12 and small.hits == 0
    for w in weights:
        roomy.matmul(w, x, F32)
    assert big.weights == 6 and big.copies == 6 and big.hits == 6


def test_a_weights_copy_goes_with_it(device) -> None:  # noqa: ANN001
    ops = device.make(vram_bytes=1 << 30)
    w = _weight(16, 64, 1)
    ops.matmul(w, np.ones((1, 64), dtype=np.float32), F32)
    assert ops.tier.stats.weights == 1 and ops.tier.stats.bytes > 0
    del w
    gc.collect()
    assert ops.tier.stats.weights == 0 and ops.tier.stats.bytes == 0


def test_rows_are_computed_alone(device) -> None:  # noqa: ANN001
    """S rows give the bits of S single-row calls (the batch never changes a result)."""
    ops = device.make()
    w = _weight(40, 192, 3)
    x = np.random.default_rng(4).standard_normal((6, 192), dtype=np.float32)
    together = ops.matmul(w, x, F32)
    for s in range(6):
        np.testing.assert_array_equal(ops.matmul(w, x[s : s + 1], F32)[0], together[s])


@pytest.mark.parametrize(
    "i,group",
    [(128, 64), (100, 64), (96, 16), (130, 0)],
    ids=["whole-chunks", "ragged-row", "groups-inside-a-chunk", "per-row-odd"],
)
def test_every_path_of_the_product_kernel(device, i: int, group: int) -> None:  # noqa: ANN001
    """The 16-byte path (whole aligned chunks under one scale) and the per-weight path
    (ragged rows, a group boundary inside a chunk) against the dequantised product."""
    w = np.random.default_rng(i).standard_normal((24, i), dtype=np.float32)
    q = quantize(w, WeightFormat.Q4, group)
    x = np.random.default_rng(5).standard_normal((5, i), dtype=np.float32)
    want = x.astype(np.float64) @ dequantize(q).astype(np.float64).T
    got = device.make().matmul(q, x, F32)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_products_launched_together_give_the_bits_of_each_alone(device) -> None:  # noqa: ANN001
    """q/k/v in one launch, every expert of a layer in one launch (the shared expert of
    another width among them): the bits of one product, or one expert, at a time."""
    ops = device.make()
    x = np.random.default_rng(6).standard_normal((3, 128), dtype=np.float32)
    weights = [_weight(o, 128, seed) for seed, o in enumerate((64, 32, 32))]
    together = ops.matmul_many(weights, x, F32)
    for w, got in zip(weights, together, strict=True):
        np.testing.assert_array_equal(got, ops.matmul(w, x, F32))

    def expert(seed: int, width: int):  # noqa: ANN202
        return SimpleNamespace(
            gate=_weight(width, 128, seed),
            up=_weight(width, 128, seed + 1),
            down=_weight(128, width, seed + 2),
        )

    experts = [expert(10, 64), expert(20, 64), expert(30, 96)]  # the last: another width
    batch = ExpertBatch(experts, [0, 2, 3, 6], [0, 2, 1, 0, 1, 2], [0.5, 0.25, 1.0, 1.0, 1.0, 1.0],
                        [0, 1, 2, 3, 4, 5])  # fmt: skip
    got, want = np.zeros((6, 128), np.float32), np.zeros((6, 128), np.float32)
    ops.apply_experts(batch, x, got, F32)
    apply_experts_each(ops, batch, x, want, F32)
    np.testing.assert_array_equal(got, want)


# ---- the I8 family: the CPU kernels' bits, so an expert may be computed on either side ----
def _any_weight(fmt: str, o: int, i: int, seed: int) -> QuantWeight:
    w = np.random.default_rng(seed).standard_normal((o, i), dtype=np.float32)
    if fmt == "fp4":  # MXFP4 codes and e8m0 bytes
        rng = np.random.default_rng(seed + 1)
        codes = rng.integers(0, 256, (o, i // 2), dtype=np.uint8)
        scales = rng.integers(120, 124, (o, i // 32)).astype(np.uint8)
        return QuantWeight(WeightFormat.FP4, (o, i), codes, scales, 32)
    if fmt == "f32":
        return QuantWeight(WeightFormat.F32, (o, i), w)
    if fmt in ("q2", "q3"):  # the low-bit affine formats of cold experts (groups of 64)
        return quantize(w, WeightFormat(fmt))
    kind, _, group = fmt.partition("-g")
    return quantize(w, WeightFormat.Q8 if kind == "int8" else WeightFormat.Q4, int(group or 0))


I8_CASES = [("int4-g64", 256), ("int4-g32", 96), ("int4", 130), ("int8", 200), ("fp4", 128),
            ("q2", 192), ("q3", 256), ("q2", 100), ("q3", 130), ("q3", 40),
            ("int4-g16", 96), ("f32", 40)]  # fmt: skip


@pytest.mark.parametrize("fmt,width", I8_CASES, ids=[f"{f}-{n}" for f, n in I8_CASES])
def test_i8_products_are_the_cpu_kernels_bits(device, fmt: str, width: int) -> None:  # noqa: ANN001
    """Every format, S = 1 and S = 5, alone and launched with others: bit for bit what the
    CPU kernels give (the last two run there: groups of 16, f32 matrices). Q2/Q3 at whole
    groups, a ragged last group (100: whole 4-code words; 130: neither) and under a group."""
    w = _any_weight(fmt, 40, width, seed=width)
    x = np.random.default_rng(1).standard_normal((5, width), dtype=np.float32) * 3
    ops, cpu = device.make(), CpuOps()
    assert device.exact(w) == (fmt not in ("int4-g16", "f32"))
    for rows in (x[:1], x):
        np.testing.assert_array_equal(ops.matmul(w, rows, I8), cpu.matmul(w, rows, I8))
    other = _any_weight("int8", 24, width, seed=3)
    for got, ref in zip(
        ops.matmul_many([w, other], x, I8), cpu.matmul_many([w, other], x, I8), strict=True
    ):
        np.testing.assert_array_equal(got, ref)


def _i8_experts(seed: int) -> list[SimpleNamespace]:
    def expert(s: int, fmt: str) -> SimpleNamespace:
        return SimpleNamespace(
            gate=_any_weight(fmt, 64, 128, s), up=_any_weight(fmt, 64, 128, s + 1),
            down=_any_weight(fmt, 128, 64, s + 2),
        )  # fmt: skip

    formats = ("int4-g64", "int8", "fp4", "int4-g16", "q2", "q3")
    return [expert(seed + 10 * k, fmt) for k, fmt in enumerate(formats)]


@pytest.mark.parametrize("host_experts", [False, True], ids=["copied", "on-the-host"])
@pytest.mark.parametrize("budget", [1 << 30, 25_000], ids=["roomy", "small-tier"])
def test_i8_experts_give_the_cpu_bits_wherever_they_are_computed(
    device,
    host_experts: bool,
    budget: int,  # noqa: ANN001
) -> None:
    """apply_experts in I8: kept on the device, copied for one op, or computed by the CPU
    kernels beside it (host_experts): the same bits as the CPU backend, twice over (the
    second pass finds the tier warm)."""
    experts = _i8_experts(5)
    x = np.random.default_rng(2).standard_normal((3, 128), dtype=np.float32)
    batch = ExpertBatch(experts, [0, 2, 3, 5, 6, 8, 9], [0, 2, 1, 0, 2, 1, 0, 1, 2],
                        [0.5, 0.25, 1.0, 0.75, 0.125, 2.0, 1.5, 0.5, 1.0],
                        [0, 1, 2, 3, 4, 5, 6, 7, 8])  # fmt: skip
    want = np.zeros((9, 128), np.float32)
    CpuOps().apply_experts(batch, x, want, I8)
    ops = device.make(vram_bytes=budget, host_experts=host_experts)
    for _ in range(2):
        got = np.zeros((9, 128), np.float32)
        ops.apply_experts(batch, x, got, I8)
        np.testing.assert_array_equal(got, want)
    stats = ops.tier.stats
    assert stats.host_experts >= 2  # the int4-g16 expert always, twice
    if budget < 1 << 30 and host_experts:
        assert stats.host_experts > 2  # experts the small tier passed through
    one = ops.expert_swiglu(experts[0].gate, experts[0].up, experts[0].down, x, I8)
    np.testing.assert_array_equal(
        one, CpuOps().expert_swiglu(experts[0].gate, experts[0].up, experts[0].down, x, I8)
    )


def test_affine_rows_past_the_webgpu_group_limit_are_computed_on_the_host(device) -> None:  # noqa: ANN001
    """mm_i8_rows holds a row's Q2/Q3 integer sums in GMAX workgroup slots, two runs of
    them (the dots and the activation sums), so webgpu computes rows of more than GMAX / 2
    groups on the CPU; cuda has no such limit. Either way: the CPU kernels' bits."""
    w = _any_weight("q2", 4, 64 * (webgpu.GMAX // 2 + 1), seed=11)
    assert not webgpu.exact_on_device(w) and cuda.exact_on_device(w)
    assert webgpu.exact_on_device(_any_weight("q3", 4, 64 * (webgpu.GMAX // 2), seed=12))
    x = np.random.default_rng(3).standard_normal((2, w.shape[1]), dtype=np.float32)
    np.testing.assert_array_equal(device.make().matmul(w, x, I8), CpuOps().matmul(w, x, I8))


def test_the_host_or_the_bus_is_decided_by_timing_both(device, caplog) -> None:  # noqa: ANN001
    ops = device.make(vram_bytes=1)  # nothing fits: every expert weight passes through
    experts = _i8_experts(7)[:1]
    batch = ExpertBatch(experts, [0, 1], [0], [1.0], [0])
    got = np.zeros((1, 128), np.float32)
    with caplog.at_level("INFO", logger="colibri.backend"):
        ops.apply_experts(batch, np.ones((1, 128), np.float32), got, I8)
    assert ops.host.fixed is not None
    assert "i8 experts the tier does not keep are" in caplog.text
    assert ops.tier.stats.host_rule.startswith("i8 experts the tier does not keep are")


def _i8_logits(ref, ops, store, profile: np.ndarray | None = None) -> np.ndarray:  # noqa: ANN001
    engine = Engine.load(ref.out_dir, family=I8, ops=ops, store=store)
    try:
        if profile is not None:
            engine.apply_profile(profile)
        session = engine.new_session()
        first = np.asarray(session.prefill(list(ref.tf_ids[:20]), all_logits=True))
        steps = [np.asarray(session.decode(int(t))) for t in ref.tf_ids[20:26]]
        return np.concatenate([first.reshape(-1), *(s.reshape(-1) for s in steps)])
    finally:
        engine.close()


def _int_experts(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """Routed experts as container tensors the device computes exactly: int4-g64 gates and
    ups, int8 downs."""
    fmt = WeightFormat.Q8 if "down" in name else WeightFormat.Q4
    return container_tensors(name, quantize(w, fmt, 64))


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3", "qwen3_moe"])
def test_i8_model_on_the_device_gives_the_cpu_logits_streamed_or_resident(
    oracle_checkpoint,
    device,
    arch: str,  # noqa: ANN001
) -> None:
    """The whole model in I8 (integer experts): the CPU backend resident, and the cuda
    backend streaming its experts (one cached a layer) through a device tier too small for
    them all, those it passes through computed on the host or copied: the same logits,
    bit for bit."""
    ref = oracle_checkpoint(arch, expert_container=_int_experts)
    want = _i8_logits(ref, CpuOps(), StoreOptions(mode="resident"))
    streamed = StoreOptions(mode="tiered", cache=1, pin="off")
    stats = {}
    for host_experts in (True, False):
        ops = device.make(vram_bytes=200_000, host_experts=host_experts)
        np.testing.assert_array_equal(_i8_logits(ref, ops, streamed), want)
        stats[host_experts] = ops.tier.stats
        assert ops.tier.stats.expert_weights > 0  # experts computed on the device
    # the MTP layer's f32 experts run on the host either way; passed-through ones only with
    # host_experts off
    assert stats[True].host_experts > stats[False].host_experts
    assert stats[False].passed > 0 and stats[True].passed == 0


def _low_bit_experts(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """Routed experts in a mix of precisions by expert (as a plan by heat makes): Q2, Q3
    and int4-g64 side by side, so one layer's experts differ in byte size."""
    expert = int(name.split(".experts.")[1].split(".")[0])
    fmt = (WeightFormat.Q2, WeightFormat.Q3, WeightFormat.Q4)[expert % 3]
    return container_tensors(name, quantize(w, fmt, 64))


def test_i8_model_with_low_bit_experts_gives_the_cpu_logits(oracle_checkpoint, device) -> None:  # noqa: ANN001
    """I8 with Q2/Q3/int4 experts side by side, streamed one a layer through a small
    device tier (passed-through experts on the host or copied): the resident CPU
    backend's logits, bit for bit."""
    ref = oracle_checkpoint("glm4_moe", expert_container=_low_bit_experts)
    want = _i8_logits(ref, CpuOps(), StoreOptions(mode="resident"))
    streamed = StoreOptions(mode="tiered", cache=1, pin="off")
    for host_experts in (True, False):
        ops = device.make(vram_bytes=200_000, host_experts=host_experts)
        np.testing.assert_array_equal(_i8_logits(ref, ops, streamed), want)
        assert ops.tier.stats.expert_weights > 0  # experts computed on the device


def test_a_profile_promotes_its_hottest_experts_onto_the_device(oracle_checkpoint, device) -> None:  # noqa: ANN001
    """Engine.apply_profile: the profile's hottest experts are copied to the device before
    the first token, as many as the tier's budget holds, and the logits do not move."""
    ref = oracle_checkpoint("glm4_moe", expert_container=_int_experts)
    store = StoreOptions(mode="resident")
    plain = _i8_logits(ref, CpuOps(), store)
    ops = device.make(vram_bytes=400_000)
    engine = Engine.load(ref.out_dir, family=I8, ops=ops, store=store)
    try:
        experts = engine.experts
        counts = np.zeros(experts.counts.shape, dtype=np.int64)
        layer = experts.layout.moe_layers[0]
        counts[layer, 3], counts[layer, 1] = 50, 40  # the two hottest, in that order
        dense = ops.tier.stats.bytes  # nothing before the profile but what load copied
        engine.apply_profile(counts)
        stats = ops.tier.stats
        assert stats.expert_weights == 6 and stats.bytes > dense
        hits = stats.hits
        for e in (3, 1):
            w = experts.get(layer, e)
            assert all(ops.tier.keep(m) is not None for m in (w.gate, w.up, w.down))
        assert stats.hits == hits + 6  # the promoted experts were on the device already
    finally:
        engine.close()
    ops = device.make(vram_bytes=400_000)
    np.testing.assert_array_equal(_i8_logits(ref, ops, store, profile=counts), plain)
    assert ops.tier.stats.hits > 0


def test_a_weight_larger_than_a_binding_is_split_and_computes_the_same() -> None:
    """An adapter binds at most so many bytes (lavapipe: 128 MiB): a larger weight is held
    in pieces of whole rows, each dispatched alone, with the bits of the whole (F32 and
    I8), and `ps` says so."""
    try:
        whole = WebgpuOps(open_device())
        split = WebgpuOps(GpuDevice(max_binding=16 << 10))
    except BackendError as exc:
        pytest.skip(str(exc))
    x = np.random.default_rng(3).standard_normal((3, 1024), dtype=np.float32)
    for fmt in ("int8", "int4-g64", "fp4", "q2", "q3"):
        w = _any_weight(fmt, 100, 1024, seed=4)
        for family in (F32, I8):
            np.testing.assert_array_equal(split.matmul(w, x, family), whole.matmul(w, x, family))
        assert len(split.tier.get(w).pieces) > 1
        np.testing.assert_array_equal(split.matmul(w, x, I8), CpuOps().matmul(w, x, I8))
    assert "a binding holds 16 KiB, larger weights are split" in split.device_tier().device
