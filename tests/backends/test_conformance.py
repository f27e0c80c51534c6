"""Every backend passes the same cases: its ops against the numpy reference (NumpyOps, to
float tolerance), the whole model against transformers on the tiny checkpoints of every
architecture (32/32 teacher-forced, 20/20 greedy at f32), and placement invariance
(resident and streamed experts give the same tokens).

A backend this machine cannot run is skipped with the reason; CI installs mlx[cpu] on
Linux (the `test` extra) so MLX is tested for real there.
"""

from __future__ import annotations

import numpy as np
import pytest
import tiny_models
from helpers.numpy_ops import NumpyOps
from test_oracle import greedy

from colibrid.backends.base import (
    ExpertBatch,
    GQAWeights,
    KernelFamily,
    ResidentExperts,
    RouteRule,
)
from colibrid.backends.cuda import CudaOps
from colibrid.backends.cuda_device import EmulatedDevice
from colibrid.backends.gqa_plan import gqa_attention_each
from colibrid.engine.backend import make_ops, mlx_installed
from colibrid.engine.engine import Engine
from colibrid.engine.generate import teacher_forced_argmax
from colibrid.errors import BackendError
from colibrid.formats.quant import container_tensors, dequantize, quantize
from colibrid.formats.weights import QuantWeight, WeightFormat
from colibrid.models.base import apply_experts_each
from colibrid.models.layers.router import route_reference
from colibrid.store.options import StoreOptions

F32 = KernelFamily.F32
RTOL, ATOL = 2e-5, 2e-5  # float32 sums in another order: a few ulps of the row's size


def _cuda_ops():  # noqa: ANN202
    try:
        return make_ops("cuda")
    except BackendError:
        pytest.skip("no NVIDIA GPU / pycuda")


def _webgpu_ops():  # noqa: ANN202
    try:
        return make_ops("webgpu")
    except BackendError as exc:
        pytest.skip(str(exc))


def _mlx_ops():  # noqa: ANN202
    if not mlx_installed():
        pytest.skip("mlx is not installed (pip install 'colibri[mlx]')")
    return make_ops("mlx")


def _make(backend: str):  # noqa: ANN202
    """The ops of ``backend``; cuda-emulated is the cuda backend's own code and kernels
    run on this CPU (backends.cuda_device.EmulatedDevice), so its arithmetic and every
    line above the device are checked where there is no GPU."""
    if backend == "cuda-emulated":
        return CudaOps(EmulatedDevice())
    return make_ops(backend)


@pytest.fixture(params=["cpu", "mlx", "cuda", "cuda-emulated", "webgpu"])
def backend(request) -> str:  # noqa: ANN001
    """The backend name, skipped when this machine cannot run it."""
    if request.param == "mlx":
        _mlx_ops()
    elif request.param == "cuda":
        _cuda_ops()
    elif request.param == "webgpu":
        _webgpu_ops()
    return request.param


@pytest.fixture
def ops(backend: str):  # noqa: ANN201
    return _make(backend)


def _weight(fmt: str, o: int, i: int, seed: int = 0) -> QuantWeight:
    """A random [o, i] weight in one of the formats a checkpoint may hold."""
    w = np.random.default_rng(seed).standard_normal((o, i), dtype=np.float32) * np.float32(0.1)
    if fmt == "f32":
        return QuantWeight(WeightFormat.F32, (o, i), w)
    if fmt == "bf16":
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)
        return QuantWeight(WeightFormat.BF16, (o, i), bits)
    if fmt == "int8":
        return quantize(w, WeightFormat.Q8)
    if fmt == "int4-row":
        return quantize(w, WeightFormat.Q4, 0)
    if fmt == "fp4":  # MXFP4 codes and e8m0 bytes (factors 2^-8 .. 2^-5)
        rng = np.random.default_rng(seed + 1)
        codes = rng.integers(0, 256, (o, i // 2), dtype=np.uint8)
        scales = rng.integers(120, 124, (o, i // 32)).astype(np.uint8)
        return QuantWeight(WeightFormat.FP4, (o, i), codes, scales, 32)
    if fmt in ("q2", "q3"):  # the low-bit affine formats of cold experts
        return quantize(w, WeightFormat(fmt))
    return quantize(w, WeightFormat.Q4, 64)


FORMATS = ["f32", "bf16", "int8", "int4-g64", "int4-row", "fp4", "q2", "q3"]


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def _x(rows: int, width: int, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, width), dtype=np.float32)


# ---- ops against the numpy reference -------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 5])
def test_matmul(ops, fmt: str, rows: int) -> None:
    w = _weight(fmt, 96, 192)
    x = _x(rows, 192)
    _close(ops.matmul(w, x, F32), NumpyOps().matmul(w, x, F32))


@pytest.mark.parametrize("fmt", ["q2", "q3"])
@pytest.mark.parametrize("width", [40, 100, 130])
def test_low_bit_affine_rows_of_any_width(ops, fmt: str, width: int) -> None:
    """Q2/Q3 rows shorter than a group, with a ragged last group, and of a width no 4 or 8
    divides: every backend reads the padded blocks and computes q * s + m (MLX dequantises
    what its groups cannot hold)."""
    w = _weight(fmt, 24, width, seed=width)
    x = _x(3, width)
    _close(ops.matmul(w, x, F32), NumpyOps().matmul(w, x, F32))


@pytest.mark.parametrize("fmt", ["int8", "int4-g64", "q3"])
def test_matmul_many_and_blocks(ops, fmt: str) -> None:
    ws = [_weight(fmt, o, 128, seed=o) for o in (64, 32, 96)]
    x = _x(3, 128)
    for got, w in zip(ops.matmul_many(ws, x, F32), ws, strict=True):
        _close(got, NumpyOps().matmul(w, x, F32))
    blocks = _x(3 * 4, 128).reshape(3, 4, 128)  # [S, B, I]: block b of W times x[:, b]
    w = _weight(fmt, 4 * 32, 128)
    want = np.concatenate(
        [NumpyOps().matmul(_rows_of(w, b * 32, 32), blocks[:, b], F32) for b in range(4)], axis=1
    )
    _close(ops.matmul_blocks(w, blocks, F32), want)


def _rows_of(w: QuantWeight, lo: int, n: int) -> QuantWeight:
    scales = None if w.scales is None else w.scales[lo : lo + n]
    return QuantWeight(w.fmt, (n, w.shape[1]), w.data[lo : lo + n], scales, w.group_size)


class _Expert:
    def __init__(self, fmt: str, d: int, f: int, seed: int) -> None:
        self.gate = _weight(fmt, f, d, seed)
        self.up = _weight(fmt, f, d, seed + 1)
        self.down = _weight(fmt, d, f, seed + 2)


@pytest.mark.parametrize("fmt", ["int8", "int4-g64", "bf16", "q2", "q3"])
def test_expert_swiglu_and_apply_experts(ops, fmt: str) -> None:
    d, f = 128, 192
    experts = [_Expert(fmt, d, f, seed=10 * k) for k in range(3)]
    x = _x(4, d)
    e = experts[0]
    _close(
        ops.expert_swiglu(e.gate, e.up, e.down, x, F32),
        NumpyOps().expert_swiglu(e.gate, e.up, e.down, x, F32),
    )
    batch = ExpertBatch(
        weights=experts,
        start=[0, 3, 3, 5],  # expert 1 has no rows
        rows=[0, 2, 3, 1, 2],
        gates=[0.5, 0.25, 1.0, 0.75, 0.125],
        dest=[0, 5, 7, 2, 6],
    )
    got = np.zeros((8, d), dtype=np.float32)
    want = np.zeros((8, d), dtype=np.float32)
    ops.apply_experts(batch, x, got, F32)
    apply_experts_each(NumpyOps(), batch, x, want, F32)
    _close(got, want)


# GLM/DeepSeek sigmoid routing with a selection bias and groups; Qwen3/Mixtral softmax
@pytest.mark.parametrize(
    "rule,biased,shared",
    [
        (RouteRule(2, 2, 1, True, 2.5), True, True),
        (RouteRule(3, 1, 1, False, 1.0, softmax=True), False, False),
    ],
)
@pytest.mark.parametrize("rows", [1, 5])
def test_moe_layer(ops, rule: RouteRule, biased: bool, shared: bool, rows: int) -> None:
    """The resident layer in one call against the numpy reference's route + experts + sum."""
    d, f, n = 128, 96, 8
    layer = ResidentExperts([_Expert("int4-g64", d, f, seed=10 * k) for k in range(n)])
    rng = np.random.default_rng(rows)
    weight = rng.standard_normal((n, d), dtype=np.float32) * np.float32(0.2)
    bias = rng.uniform(-0.1, 0.1, n).astype(np.float32) if biased else None
    common = _Expert("int8", d, f, seed=99) if shared else None
    x = _x(rows, d)
    ids, out = ops.moe(x, weight, bias, rule, layer, common, F32)
    want_ids, want = NumpyOps().moe(x, weight, bias, rule, layer, common, F32)
    assert np.array_equal(np.asarray(ids), want_ids)
    _close(out, want)


@pytest.mark.parametrize("fmt", ["f32", "int8", "int4-g64"])
@pytest.mark.parametrize("rows,start", [(1, 0), (1, 17), (5, 3)])
# Qwen3-MoE's per-head qk-norm; OLMoE's norms over the whole projections with Mixtral's
# sliding window (shorter than the context, so it cuts keys)
# ... and gpt-oss's sinks with a window
@pytest.mark.parametrize(
    "whole,window,sinks", [(False, None, False), (True, 4, False), (False, 4, True)]
)
def test_gqa_attention_block(
    ops, fmt: str, rows: int, start: int, whole: bool, window: int | None, sinks: bool
) -> None:
    heads, kv_heads, d, hidden, cap = 4, 2, 32, 128, 24
    rng = np.random.default_rng(rows + start)
    q_span, k_span = (heads * d, kv_heads * d) if whole else (d, d)
    block = GQAWeights(
        _weight(fmt, heads * d, hidden, 1),
        _weight(fmt, kv_heads * d, hidden, 2),
        _weight(fmt, kv_heads * d, hidden, 3),
        _weight(fmt, hidden, heads * d, 4),
        biases=tuple(rng.standard_normal(n, dtype=np.float32) for n in (128, 64, 64)),
        qk_norm=tuple(rng.uniform(0.5, 1.5, n).astype(np.float32) for n in (q_span, k_span)),
        qk_norm_whole=whole,
        window=window,
        sinks=np.linspace(-1.0, 3.0, heads, dtype=np.float32) if sinks else None,
    )
    angles = rng.uniform(0, 6.3, (rows, 8)).astype(np.float32)  # partial RoPE: 16 of 32 dims
    rope = (np.cos(angles), np.sin(angles))
    x = _x(rows, hidden)
    history = rng.standard_normal((2, cap, kv_heads, d), dtype=np.float32)
    got_caches = (history[0].copy(), history[1].copy())
    want_caches = (history[0].copy(), history[1].copy())
    got = ops.gqa_attention(block, rope, x, got_caches, start, d**-0.5, F32)
    want = gqa_attention_each(NumpyOps(), block, rope, x, want_caches, start, d**-0.5, F32)
    _close(got, want)
    for g, w in zip(got_caches, want_caches, strict=True):
        _close(g, w)  # the new rows written, the others untouched


def test_norms_rope_attend_and_rank_sum(ops) -> None:
    ref = NumpyOps()
    rng = np.random.default_rng(3)
    h, delta = _x(3, 64, 1), _x(3, 64, 2)
    weight = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    _close(ops.rms_norm(h, weight, 1e-5), ref.rms_norm(h, weight, 1e-5))
    got, want = ops.add_rms_norm(h, delta, weight, 1e-5), ref.add_rms_norm(h, delta, weight, 1e-5)
    for g, w in zip(got, want, strict=True):
        _close(g, w)
    q = rng.standard_normal((3, 4, 32), dtype=np.float32)
    angles = rng.uniform(0, 6.3, (3, 12)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    _close(ops.rope_half(q, cos, sin), ref.rope_half(q, cos, sin))
    keys = rng.standard_normal((9, 2, 32), dtype=np.float32)
    values = rng.standard_normal((9, 2, 32), dtype=np.float32)
    _close(ops.attend_gqa(q, keys, values, 0.2, 6), ref.attend_gqa(q, keys, values, 0.2, 6))
    windowed = ops.attend_gqa(q, keys, values, 0.2, 6, 3)
    _close(windowed, ref.attend_gqa(q, keys, values, 0.2, 6, 3))
    assert not np.allclose(windowed, ref.attend_gqa(q, keys, values, 0.2, 6))
    # gpt-oss's sinks: one logit per head in the softmax (one large enough to take most of
    # a head's weight), with and without a window
    sinks = np.array([-1.0, 0.5, 8.0, 2.0], dtype=np.float32)
    for window in (None, 3):
        sunk = ops.attend_gqa(q, keys, values, 0.2, 6, window, sinks)
        _close(sunk, ref.attend_gqa(q, keys, values, 0.2, 6, window, sinks))
        assert not np.allclose(sunk, ref.attend_gqa(q, keys, values, 0.2, 6, window))
    parts = rng.standard_normal((3, 4, 64), dtype=np.float32)
    _close(ops.rank_sum(parts), ref.rank_sum(parts))


@pytest.mark.parametrize(
    "rule,n",
    [
        (RouteRule(top_k=2), 4),
        (RouteRule(top_k=4, n_group=4, topk_group=2, norm=True, scaling=2.5), 6),
        (RouteRule(top_k=3, norm=False, scaling=1.0), 3),
        (RouteRule(top_k=2, norm=False, softmax=True), 5),  # Mixtral / Qwen3 without renorm
        (RouteRule(top_k=3, norm=True, softmax=True), 3),
    ],
)
def test_route(ops, rule: RouteRule, n: int) -> None:
    rng = np.random.default_rng(5)
    h = _x(6, 64)
    weight = rng.standard_normal((16, 64), dtype=np.float32) * np.float32(0.1)
    bias = rng.standard_normal(16, dtype=np.float32) * np.float32(0.01)
    ids, gates = ops.route(h, weight, bias, rule, n)
    want_ids, want_gates = route_reference(h, weight, bias, rule, n)
    assert ids.dtype == np.int64 and np.array_equal(ids, want_ids)
    _close(gates, want_gates)


def test_route_ties_go_to_the_lowest_expert(ops) -> None:
    h = np.zeros((2, 8), dtype=np.float32)  # every score is sigmoid(0): all tied
    weight = np.ones((16, 8), dtype=np.float32)
    ids, _ = ops.route(h, weight, None, RouteRule(top_k=4, n_group=4, topk_group=2), 6)
    assert ids.tolist() == [[0, 1, 2, 3, 4, 5]] * 2


# ---- the whole model -----------------------------------------------------------------------
def _load(ref: tiny_models.OracleReference, backend: str, store: StoreOptions | None = None):  # noqa: ANN202
    return Engine.load(ref.out_dir, family=F32, ops=_make(backend), store=store)


@pytest.mark.slow
@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_model_matches_transformers(oracle_checkpoint, backend: str, arch: str) -> None:
    ref = oracle_checkpoint(arch)
    engine = _load(ref, backend)
    try:
        tf = teacher_forced_argmax(engine, ref.tf_ids)
        assert tf == ref.tf_pred, f"teacher-forced {sum(map(int.__eq__, tf, ref.tf_pred))}/32"
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_placement_never_changes_tokens(oracle_checkpoint, backend: str, arch: str) -> None:
    ref = oracle_checkpoint(arch)
    tokens = []
    for store in (StoreOptions(mode="resident"), StoreOptions(mode="tiered", cache=1, pin="off")):
        engine = _load(ref, backend, store)
        try:
            tokens.append(
                (teacher_forced_argmax(engine, ref.tf_ids), greedy(engine, ref.prompt_ids))
            )
        finally:
            engine.close()
    assert tokens[0] == tokens[1]
    assert tokens[0][1] == ref.greedy_ids


def test_mlx_refuses_the_i8_family(oracle_checkpoint) -> None:
    """I8 is the CPU kernels' bit-exact integer contract: MLX says so at load, and at an op."""
    ops = _mlx_ops()
    assert ops.families == frozenset({F32})
    with pytest.raises(BackendError, match="f32 kernel family only"):
        ops.matmul(_weight("int8", 8, 64), _x(1, 64), KernelFamily.I8)
    with pytest.raises(BackendError, match="mlx backend computes the f32 kernel family only"):
        Engine.load(oracle_checkpoint("glm4_moe").out_dir, family=KernelFamily.I8, ops=ops)


@pytest.fixture(scope="module")
def int4_checkpoint(oracle_checkpoint):  # noqa: ANN001, ANN201
    """``int4_checkpoint(arch)``: the tiny checkpoint with its routed experts as int4-g64
    container tensors and the reference on their dequantised values; built once per
    architecture for every backend."""
    built: dict[str, tiny_models.OracleReference] = {}

    def roundtrip(name: str, w: np.ndarray) -> np.ndarray:
        return dequantize(quantize(w, WeightFormat.Q4, 64))

    def as_container(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
        return container_tensors(name, quantize(w, WeightFormat.Q4, 64))

    def get(arch: str) -> tiny_models.OracleReference:
        if arch not in built:
            built[arch] = oracle_checkpoint(
                arch, expert_transform=roundtrip, expert_container=as_container
            )
        return built[arch]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_quantised_experts_match_dequantised_reference(
    int4_checkpoint, backend: str, arch: str
) -> None:
    """Routed experts as int4-g64 container tensors (MLX: its quantised matmul)."""
    ref = int4_checkpoint(arch)
    engine = _load(ref, backend)
    try:
        layer = engine.experts.layout.moe_layers[0]
        assert engine.experts.get(layer, 0).gate.fmt == WeightFormat.Q4
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()


def _cold_format(name: str) -> WeightFormat:
    """A mix of precisions by expert, as a plan by heat makes: Q2, Q3 and int4-g64 experts
    side by side (so experts of one layer differ in byte size)."""
    expert = int(name.split(".experts.")[1].split(".")[0])
    return (WeightFormat.Q2, WeightFormat.Q3, WeightFormat.Q4)[expert % 3]


@pytest.fixture(scope="module")
def low_bit_checkpoint(oracle_checkpoint):  # noqa: ANN001, ANN201
    """``low_bit_checkpoint(arch)``: the tiny checkpoint with its routed experts stored in
    a mix of Q2, Q3 and int4-g64 container tensors and the reference on their dequantised
    values; built once per architecture for every backend."""
    built: dict[str, tiny_models.OracleReference] = {}

    def roundtrip(name: str, w: np.ndarray) -> np.ndarray:
        return dequantize(quantize(w, _cold_format(name), 64))

    def as_container(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
        return container_tensors(name, quantize(w, _cold_format(name), 64))

    def get(arch: str) -> tiny_models.OracleReference:
        if arch not in built:
            built[arch] = oracle_checkpoint(
                arch, expert_transform=roundtrip, expert_container=as_container
            )
        return built[arch]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["glm4_moe", "qwen3_moe"])
def test_low_bit_experts_match_dequantised_reference(
    low_bit_checkpoint, backend: str, arch: str
) -> None:
    """Routed experts in Q2, Q3 and int4-g64 side by side, resident and streamed one at a
    time: transformers' greedy tokens on the dequantised weights (MLX: its quantised
    matmul at 2, 3 and 4 bits)."""
    ref = low_bit_checkpoint(arch)
    for store in (StoreOptions(mode="resident"), StoreOptions(mode="tiered", cache=1, pin="off")):
        engine = _load(ref, backend, store)
        try:
            layer = engine.experts.layout.moe_layers[0]
            formats = [engine.experts.get(layer, e).gate.fmt for e in range(3)]
            assert formats == [WeightFormat.Q2, WeightFormat.Q3, WeightFormat.Q4]
            assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
        finally:
            engine.close()
