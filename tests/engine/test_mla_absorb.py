"""MLA absorption on kv_b_proj in its stored format: the per-head key and value products
equal the float products on the dequantised weight (F32-family tolerance), for every
format the converter writes, without ever expanding the weight to float (except the
documented ragged-group fallback)."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.backends.base import KernelFamily
from colibrid.backends.cpu import CpuOps
from colibrid.formats.quant import dequantize, quantize
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
