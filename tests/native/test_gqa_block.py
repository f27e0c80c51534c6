"""The one-call GQA attention block equals the same ops called one by one
(`gqa_attention_each` over CpuOps), bit for bit: output and the cache rows it writes,
with and without biases and qk-norm (per head, or over the whole projection as OLMoE),
partial RoPE, a sliding window, one row and several, an empty and a filled cache; bad
shapes are refused before C runs."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.backends.base import GQAWeights, KernelFamily
from colibrid.backends.cpu import CpuOps
from colibrid.backends.gqa_plan import gqa_attention_each
from colibrid.formats.weights import WeightFormat

native = pytest.importorskip("colibrid.backends.native")

H, G, D_HEAD, HIDDEN, CAP = 6, 2, 32, 128, 40


def _case(kit, fmt: WeightFormat, rows: int, start: int, bias: bool, qk_norm: bool, half: int):
    gs = 64 if fmt == WeightFormat.Q4 else 0
    weights = (
        kit.make_weight(fmt, H * D_HEAD, HIDDEN, gs, seed=1),
        kit.make_weight(fmt, G * D_HEAD, HIDDEN, gs, seed=2),
        kit.make_weight(fmt, G * D_HEAD, HIDDEN, gs, seed=3),
        kit.make_weight(fmt, HIDDEN, H * D_HEAD, gs, seed=4),
    )
    rng = np.random.default_rng(rows * 100 + start)
    biases = (
        tuple(
            rng.standard_normal(n, dtype=np.float32) for n in (H * D_HEAD, G * D_HEAD, G * D_HEAD)
        )
        if bias
        else None
    )
    norms = (
        tuple(rng.uniform(0.5, 1.5, D_HEAD).astype(np.float32) for _ in range(2))
        if qk_norm
        else None
    )
    angles = rng.uniform(0, 6.3, (rows, half)).astype(np.float32)
    rope = (np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))
    x = rng.standard_normal((rows, HIDDEN), dtype=np.float32)
    keys = rng.standard_normal((CAP, G, D_HEAD), dtype=np.float32)  # earlier rows: history
    values = rng.standard_normal((CAP, G, D_HEAD), dtype=np.float32)
    return weights, biases, norms, rope, x, keys, values


@pytest.mark.parametrize("family", [KernelFamily.F32, KernelFamily.I8])
@pytest.mark.parametrize("fmt", [WeightFormat.Q8, WeightFormat.Q4, WeightFormat.F32])
@pytest.mark.parametrize(
    "rows,start,bias,qk_norm,half",
    [
        (1, 0, False, False, 16),
        (1, 17, True, True, 8),
        (5, 3, True, False, 16),
        (7, 30, False, True, 4),
    ],
)
def test_block_equals_the_ops_one_by_one(
    kit, family, fmt, rows, start, bias, qk_norm, half
) -> None:
    weights, biases, norms, rope, x, keys, values = _case(
        kit, fmt, rows, start, bias, qk_norm, half
    )
    history = keys.copy()
    k_ref, v_ref = keys.copy(), values.copy()
    want = gqa_attention_each(
        CpuOps(),
        GQAWeights(*weights, biases, norms, 1e-6),
        rope,
        x,
        (k_ref, v_ref),
        start,
        0.17,
        family,
    )
    got = native.gqa_attention(
        GQAWeights(*weights, biases, norms, 1e-6), rope, x, (keys, values), start, 0.17, family
    )
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(keys.view(np.uint32), k_ref.view(np.uint32))  # same rows written
    assert np.array_equal(values.view(np.uint32), v_ref.view(np.uint32))
    assert not np.array_equal(keys[start : start + rows], history[start : start + rows])
    assert np.array_equal(keys[:start], history[:start])  # earlier rows untouched


@pytest.mark.parametrize("family", [KernelFamily.F32, KernelFamily.I8])
@pytest.mark.parametrize(
    "rows,start,whole,window",
    [
        (1, 17, True, None),
        (5, 3, True, 4),
        (7, 30, False, 6),
        (1, 30, False, 1),
        (3, 0, True, 40),
    ],
)
def test_whole_projection_norms_and_a_window_equal_the_ops_one_by_one(
    kit, family, rows, start, whole, window
) -> None:
    weights, biases, _, rope, x, keys, values = _case(
        kit, WeightFormat.Q8, rows, start, True, False, 8
    )
    rng = np.random.default_rng(7)
    spans = (H * D_HEAD, G * D_HEAD) if whole else (D_HEAD, D_HEAD)
    norms = tuple(rng.uniform(0.5, 1.5, n).astype(np.float32) for n in spans)

    def block() -> GQAWeights:
        return GQAWeights(*weights, biases, norms, 1e-5, qk_norm_whole=whole, window=window)

    k_ref, v_ref = keys.copy(), values.copy()
    want = gqa_attention_each(CpuOps(), block(), rope, x, (k_ref, v_ref), start, 0.2, family)
    got = native.gqa_attention(block(), rope, x, (keys, values), start, 0.2, family)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(keys.view(np.uint32), k_ref.view(np.uint32))
    plain = GQAWeights(*weights, biases, norms, 1e-5, qk_norm_whole=whole)
    unlimited = native.gqa_attention(
        plain, rope, x, (keys.copy(), values.copy()), start, 0.2, family
    )
    assert np.array_equal(got, unlimited) == (window is None or window >= start + rows)


def test_norm_weights_must_span_what_they_normalise(kit) -> None:
    weights, _, _, rope, x, keys, values = _case(kit, WeightFormat.Q8, 1, 0, False, False, 8)
    per_head = tuple(np.ones(D_HEAD, dtype=np.float32) for _ in range(2))
    with pytest.raises(ValueError, match="qk_norm"):
        native.gqa_attention(
            GQAWeights(*weights, None, per_head, 1e-6, qk_norm_whole=True),
            rope,
            x,
            (keys, values),
            0,
            0.1,
            KernelFamily.F32,
        )
    with pytest.raises(ValueError, match="window"):
        native.gqa_attention(
            GQAWeights(*weights, window=0), rope, x, (keys, values), 0, 0.1, KernelFamily.F32
        )


def test_rows_outside_the_cache_and_bad_shapes_are_refused(kit) -> None:
    weights, biases, norms, rope, x, keys, values = _case(
        kit, WeightFormat.Q8, 2, 0, False, False, 16
    )
    family = KernelFamily.F32
    block = GQAWeights(*weights)
    with pytest.raises(ValueError, match="do not fit a cache"):
        native.gqa_attention(block, rope, x, (keys, values), CAP - 1, 0.1, family)
    with pytest.raises(ValueError, match="disagree"):
        wrong = GQAWeights(weights[0], weights[0], weights[2], weights[3])
        native.gqa_attention(wrong, rope, x, (keys, values), 0, 0.1, family)
    with pytest.raises(ValueError, match="cos"):
        short = (rope[0][:1], rope[1][:1])
        native.gqa_attention(block, short, x, (keys, values), 0, 0.1, family)
    with pytest.raises(ValueError, match="writable"):
        keys.flags.writeable = False
        native.gqa_attention(block, rope, x, (keys, values), 0, 0.1, family)


def test_a_layer_checked_once_is_still_checked_per_call_and_follows_its_arguments(kit) -> None:
    """The static half (weights, biases, norms) is checked once and kept on the block;
    the rows, caches and RoPE are checked every call, and another block with other biases
    is checked on its own."""
    weights, biases, norms, rope, x, keys, values = _case(kit, WeightFormat.Q8, 1, 4, True, True, 8)
    family = KernelFamily.F32
    first = native.gqa_attention(
        GQAWeights(*weights, biases, norms, 1e-6), rope, x, (keys, values), 4, 0.2, family
    )
    other = tuple(b + 1.0 for b in biases)
    k2, v2 = keys.copy(), values.copy()
    want = gqa_attention_each(
        CpuOps(), GQAWeights(*weights, other, norms, 1e-6), rope, x, (k2, v2), 4, 0.2, family
    )
    got = native.gqa_attention(
        GQAWeights(*weights, other, norms, 1e-6), rope, x, (keys, values), 4, 0.2, family
    )
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not np.array_equal(got, first)
    with pytest.raises(ValueError, match="do not fit a cache"):
        native.gqa_attention(
            GQAWeights(*weights, other, norms, 1e-6), rope, x, (keys, values), CAP, 0.2, family
        )
    with pytest.raises(ValueError, match="x has shape"):
        native.gqa_attention(
            GQAWeights(*weights, other, norms, 1e-6),
            rope,
            x[:, :64],
            (keys, values),
            4,
            0.2,
            family,
        )
