"""MLA absorption on kv_b_proj in its stored format: the per-head key and value products
equal the float products on the dequantised weight (F32-family tolerance), for every
format the converter writes, without ever expanding the weight to float (except the
documented ragged-group fallback)."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.backends.base import KernelFamily
from colibrid.backends.cpu import CpuOps
from colibrid.formats.quant import dequantize, nibble_codes, pack_codes, quantize
from colibrid.formats.weights import WeightFormat
from colibrid.models.layers.absorb import split_kv_b

H, N, V, C = 4, 24, 16, 128


def _close(got: np.ndarray, want: np.ndarray, mags: np.ndarray) -> None:
    assert np.all(np.abs(got - want) <= 1e-5 * mags + 1e-30)


@pytest.mark.parametrize(
    "fmt,gs",
    [
        (WeightFormat.Q8, 0),
        (WeightFormat.Q4, 0),
        (WeightFormat.Q4, 64),
        (WeightFormat.Q4, 32),
        (WeightFormat.Q4, 48),
        (WeightFormat.F32, 0),
    ],
)
def test_absorbed_products_match_dequantised_weight(fmt, gs) -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((H * (N + V), C)).astype(np.float32)
    kv_b = (
        quantize(w, fmt, gs)
        if fmt != WeightFormat.F32
        else type(quantize(w, WeightFormat.Q8))(WeightFormat.F32, w.shape, w)
    )
    deq = dequantize(kv_b).astype(np.float64).reshape(H, N + V, C)
    w_k, w_v = deq[:, :N], deq[:, N:]  # [H, N, C], [H, V, C]
    absorb, wv = split_kv_b(kv_b, H, N, V)
    ragged = fmt == WeightFormat.Q4 and gs and C % gs
    assert wv.fmt == (WeightFormat.F32 if ragged else fmt)
    assert absorb.weight.fmt == (WeightFormat.F32 if ragged else fmt)
    ops = CpuOps()
    q = rng.standard_normal((3, H, N)).astype(np.float32)
    got = absorb(ops, q, KernelFamily.F32)  # [S, H, C]
    want = np.einsum("shn,hnc->shc", q.astype(np.float64), w_k)
    _close(got, want, np.einsum("shn,hnc->shc", np.abs(q), np.abs(w_k)))
    o = rng.standard_normal((3, H, C)).astype(np.float32)
    got_v = ops.matmul_blocks(wv, o, KernelFamily.F32).reshape(3, H, V)
    want_v = np.einsum("shc,hvc->shv", o.astype(np.float64), w_v)
    _close(got_v, want_v, np.einsum("shc,hvc->shv", np.abs(o), np.abs(w_v)))


@pytest.mark.parametrize("nope", [24, 23])
def test_keys_are_the_stored_codes_transposed(nope) -> None:
    """W_k^T holds exactly the checkpoint's int4 codes, per head transposed (an odd width
    padded with Q4's zero), and its scales move onto the query block for block."""
    rng = np.random.default_rng(5)
    kv_b = quantize(
        rng.standard_normal((H * (nope + V), C)).astype(np.float32), WeightFormat.Q4, 64
    )
    absorb, wv = split_kv_b(kv_b, H, nope, V)
    codes = nibble_codes(kv_b.data, C).reshape(H, nope + V, C)
    got = nibble_codes(absorb.weight.data, nope).reshape(H, C, nope)
    assert np.array_equal(got, codes[:, :nope].transpose(0, 2, 1))
    assert absorb.weight.data.shape == (H * C, (nope + 1) // 2)
    if nope % 2:
        assert np.all(absorb.weight.data[:, -1] >> 4 == 8)
    assert np.array_equal(
        absorb.scales, kv_b.scales.reshape(H, nope + V, -1)[:, :nope].transpose(0, 2, 1)
    )
    assert np.array_equal(nibble_codes(wv.data, C).reshape(H, V, C), codes[:, nope:])
    assert np.array_equal(pack_codes(nibble_codes(kv_b.data, C)), kv_b.data)


def test_a_constant_placeholder_is_split_without_copies() -> None:
    """engine.validate walks the model with zero-stride placeholders: splitting one must
    allocate nothing (it used to copy and transpose ~50 MB a layer at GLM-5's shape) and
    give the shapes the real weight would."""
    shape = (H * (N + V), C)
    placeholder = type(quantize(np.ones((1, 64), np.float32), WeightFormat.Q8))(
        WeightFormat.F32, shape, np.broadcast_to(np.float32(0), shape)
    )
    absorb, wv = split_kv_b(placeholder, H, N, V)
    assert absorb.weight.shape == (H * C, N) and wv.shape == (H * V, C)
    assert absorb.weight.data.shape == (H * C, N) and wv.data.shape == (H * V, C)
    assert not any(absorb.weight.data.strides) and not any(wv.data.strides)
    assert absorb.scales is None and not np.any(absorb.weight.data)
