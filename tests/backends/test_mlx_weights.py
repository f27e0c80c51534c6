"""colibri weights on the MLX side: int4-g64 and int8 map onto MLX's affine quantisation
without repacking (the codes are the same bytes), Q2/Q3 onto it at 2 and 3 bits with their
codes repacked, and MLX's quantised matmul then equals numpy's dequantise-and-multiply to
float tolerance."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from colibrid.formats.quant import dequantize, quantize
from colibrid.formats.weights import QuantWeight, WeightFormat

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'colibri[mlx]')")
from colibrid.backends.mlx import MlxOps  # noqa: E402
from colibrid.backends.mlx_weights import convert  # noqa: E402


def _w(o: int, i: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((o, i), dtype=np.float32)


@pytest.mark.parametrize(
    "fmt,gs,bits", [(WeightFormat.Q4, 64, 4), (WeightFormat.Q4, 128, 4), (WeightFormat.Q8, 0, 8)]
)
def test_quantised_codes_map_without_repacking(fmt: WeightFormat, gs: int, bits: int) -> None:
    w = quantize(_w(48, 256), fmt, gs)
    m = convert(w)
    assert m.packed is not None and m.bits == bits and m.dense is None
    unpacked = mx.dequantize(m.packed, m.scales, m.biases, group_size=m.group_size, bits=bits)
    np.testing.assert_allclose(np.array(unpacked), dequantize(w), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fmt,gs", [(WeightFormat.Q4, 64), (WeightFormat.Q8, 0)])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_quantized_matmul_equals_dequantise_and_matmul(
    fmt: WeightFormat, gs: int, rows: int
) -> None:
    w = quantize(_w(96, 320, seed=rows), fmt, gs)
    x = np.random.default_rng(1).standard_normal((rows, 320), dtype=np.float32)
    got = np.array(convert(w).matmul(mx.array(x)))
    want = (x.astype(np.float64) @ dequantize(w).astype(np.float64).T).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "w",
    [
        quantize(_w(8, 64), WeightFormat.Q4, 0),  # per-row int4: no MLX group fits
        quantize(_w(8, 96), WeightFormat.Q4, 64),  # a partial last group
        quantize(_w(8, 40), WeightFormat.Q8, 0),  # I not a multiple of 64
        QuantWeight(
            WeightFormat.BF16, (8, 64), (_w(8, 64).view(np.uint32) >> 16).astype(np.uint16)
        ),
    ],
    ids=["int4-row", "int4-partial-group", "int8-short-row", "bf16"],
)
def test_other_layouts_are_dequantised_once(w: QuantWeight) -> None:
    m = convert(w)
    assert m.packed is None and m.dense is not None
    np.testing.assert_array_equal(np.array(m.dense), dequantize(w))


def test_a_weight_converts_once_and_its_copy_goes_with_it() -> None:
    tier = MlxOps().tier
    w = quantize(_w(16, 128), WeightFormat.Q4, 64)
    assert tier.get(w) is tier.get(w)
    twin = QuantWeight(w.fmt, w.shape, w.data, w.scales, w.group_size)
    assert tier.get(twin) is not tier.get(w)  # kept per object
    assert tier.stats.weights == 2 and tier.stats.copies == 2 and tier.stats.hits == 2
    assert tier.stats.bytes == 2 * convert(w).nbytes > 0
    del twin
    gc.collect()
    assert tier.stats.weights == 1  # dropped with it


def test_fp4_is_mlx_mxfp4_as_stored() -> None:
    """FP4 (MXFP4 kept as stored) is MLX's mxfp4 mode over the same bytes: the codes as
    little-endian words, the e8m0 scale bytes as they are; it dequantises to exactly the
    reference and its matmul equals dequantise-and-multiply to float tolerance."""
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 256, (40, 128), dtype=np.uint8)
    scales = rng.integers(110, 140, (40, 8)).astype(np.uint8)
    w = QuantWeight(WeightFormat.FP4, (40, 256), codes, scales, 32)
    m = convert(w)
    assert m.mode == "mxfp4" and m.bits == 4 and m.dense is None and m.biases is None
    unpacked = mx.dequantize(m.packed, m.scales, None, group_size=32, bits=4, mode="mxfp4")
    np.testing.assert_array_equal(np.array(unpacked.astype(mx.float32)), dequantize(w))
    x = rng.standard_normal((5, 256), dtype=np.float32)
    got = np.array(m.matmul(mx.array(x)))
    want = (x.astype(np.float64) @ dequantize(w).astype(np.float64).T).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    half = m.rows(8, 24)  # a slice keeps the mode
    np.testing.assert_allclose(
        np.array(half.matmul(mx.array(x))), want[:, 8:24], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("fmt,bits", [(WeightFormat.Q2, 2), (WeightFormat.Q3, 3)])
def test_low_bit_affine_is_mlx_affine_at_its_bits(fmt: WeightFormat, bits: int) -> None:
    """Q2/Q3 are MLX's affine quantisation at 2 and 3 bits (s * q + m, MLX's bias being the
    minimum): the codes repacked into MLX's bit stream dequantise to exactly the reference,
    the matmul equals dequantise-and-multiply to float tolerance, and a slice of rows keeps
    the packing."""
    w = quantize(_w(40, 320, seed=bits), fmt)
    m = convert(w)
    assert m.packed is not None and m.dense is None and m.bits == bits and m.group_size == 64
    unpacked = mx.dequantize(m.packed, m.scales, m.biases, group_size=64, bits=bits)
    np.testing.assert_array_equal(np.array(unpacked), dequantize(w))
    x = np.random.default_rng(bits).standard_normal((5, 320), dtype=np.float32)
    want = (x.astype(np.float64) @ dequantize(w).astype(np.float64).T).astype(np.float32)
    np.testing.assert_allclose(np.array(m.matmul(mx.array(x))), want, rtol=1e-5, atol=1e-5)
    part = m.rows(8, 24)
    np.testing.assert_allclose(
        np.array(part.matmul(mx.array(x))), want[:, 8:24], rtol=1e-5, atol=1e-5
    )


def test_low_bit_affine_rows_of_a_partial_group_are_dequantised_once() -> None:
    w = quantize(_w(8, 100), WeightFormat.Q3)
    m = convert(w)
    assert m.packed is None and m.dense is not None
    np.testing.assert_array_equal(np.array(m.dense), dequantize(w))
