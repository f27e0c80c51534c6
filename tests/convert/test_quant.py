"""The quantisation maths of docs/formats.md against hand-worked examples and torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from colibrid.formats import quant
from colibrid.formats.weights import QuantWeight, WeightFormat


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


# ---- hand-worked examples ---------------------------------------------------------


def test_q8_hand_worked_with_half_to_even_ties():
    # absmax 254 -> s = 2 exactly; -63.5 -> -64, 0.5 -> 0, 1.5 -> 2, 2.5 -> 2 (to even)
    w = f32([[254, -127, 1, 3, 5]])
    qw = quant.quantize(w, WeightFormat.Q8)
    assert qw.fmt is WeightFormat.Q8 and qw.shape == (1, 5) and qw.group_size == 0
    assert qw.data.dtype == np.int8
    assert qw.data.tolist() == [[127, -64, 0, 2, 2]]
    assert qw.scales.dtype == np.float32 and qw.scales.tolist() == [2.0]


def test_all_zero_row_gets_scale_floor():
    qw = quant.quantize(np.zeros((2, 3), np.float32), WeightFormat.Q8)
    assert qw.scales.tolist() == [np.float32(1e-8)] * 2
    assert not qw.data.any()
    q4 = quant.quantize(np.zeros((1, 3), np.float32), WeightFormat.Q4, group_size=0)
    assert q4.scales.tolist() == [np.float32(1e-8)]
    assert q4.data.tolist() == [[0x88, 0x88]]  # q = 0 stored as 8, pad nibble 8


def test_q4_per_row_odd_width_packing():
    # absmax 7 -> s = 1; -3.5 -> -4 and 1.5 -> 2 and 0.5 -> 0 (half to even)
    w = f32([[7, -3.5, 1.5, 0.5, -7]])
    qw = quant.quantize(w, WeightFormat.Q4, group_size=0)
    assert qw.data.dtype == np.uint8 and qw.data.shape == (1, 3)
    # q+8 = [15, 4, 10, 8, 1]; low nibble = even element; odd I pads the high nibble with 8
    assert qw.data.tolist() == [[0x4F, 0x8A, 0x81]]
    assert qw.scales.shape == (1,) and qw.scales.tolist() == [1.0]
    assert quant.dequantize(qw).tolist() == [[7, -4, 2, 0, -7]]


def test_q4_grouped_partial_last_group():
    # gs 4, I 6: group 0 absmax 7 -> s 1; partial group 1 [14, -7] absmax 14 -> s 2
    w = f32([[0.5, 1, -3.5, 7, 14, -7]])
    qw = quant.quantize(w, WeightFormat.Q4, group_size=4)
    assert qw.group_size == 4 and qw.scales.shape == (1, 2)
    assert qw.scales.tolist() == [[1.0, 2.0]]
    # q = [0, 1, -4, 7 | 7, -4] -> nibbles [8, 9, 4, 15, 15, 4]
    assert qw.data.tolist() == [[0x98, 0xF4, 0x4F]]
    assert quant.dequantize(qw).tolist() == [[0, 1, -4, 7, 14, -8]]


def test_q8_ignores_group_size():
    qw = quant.quantize(f32([[1, 2, 3]]), WeightFormat.Q8, group_size=2)
    assert qw.group_size == 0 and qw.scales.shape == (1,)


def test_scale_is_computed_in_float32():
    w = f32([[0.1, -0.3, 0.7]])
    qw = quant.quantize(w, WeightFormat.Q8)
    expected = np.maximum(np.float32(0.7) / np.float32(127), np.float32(1e-8))
    assert qw.scales[0] == expected
    q = np.clip(np.rint(w / expected), -128, 127).astype(np.int8)
    assert np.array_equal(qw.data, q)


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        quant.quantize(np.zeros(3, np.float32), WeightFormat.Q8)
    with pytest.raises(ValueError):
        quant.quantize(np.zeros((2, 2), np.float32), WeightFormat.F32)
    with pytest.raises(ValueError):
        quant.quantize(f32([[1, np.nan]]), WeightFormat.Q8)


# ---- properties -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "gs", "qmax"),
    [
        (WeightFormat.Q8, 0, 127),
        (WeightFormat.Q4, 0, 7),
        (WeightFormat.Q4, 64, 7),
        (WeightFormat.Q4, 32, 7),
    ],
)
def test_round_trip_error_bound(fmt, gs, qmax):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((37, 203)).astype(np.float32) * 0.05
    qw = quant.quantize(w, fmt, group_size=gs)
    back = quant.dequantize(qw)
    assert back.dtype == np.float32 and back.shape == w.shape
    if gs:
        s = np.repeat(qw.scales, gs, axis=1)[:, : w.shape[1]]
    else:
        s = qw.scales[:, None]
    assert np.all(np.abs(w - back) <= s * np.float32(0.5) * (1 + 1e-5))
    if not gs:  # the largest element of every row comes back within an ulp or so
        assert np.allclose(np.abs(back).max(axis=1), np.abs(w).max(axis=1), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("fmt", "gs"), [(WeightFormat.Q8, 0), (WeightFormat.Q4, 0), (WeightFormat.Q4, 64)]
)
def test_row_blocking_is_bit_identical(monkeypatch, fmt, gs):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((50, 130)).astype(np.float32)
    whole = quant.quantize(w, fmt, group_size=gs)
    monkeypatch.setattr(quant, "BLOCK_ELEMENTS", 300)  # blocks of 2 rows
    blocked = quant.quantize(w, fmt, group_size=gs)
    assert np.array_equal(whole.data, blocked.data)
    assert np.array_equal(whole.scales, blocked.scales)
    assert np.array_equal(quant.dequantize(whole), quant.dequantize(blocked))


@pytest.mark.parametrize(
    ("fmt", "gs"), [(WeightFormat.Q8, 0), (WeightFormat.Q4, 0), (WeightFormat.Q4, 16)]
)
def test_dequantize_rows_matches_full(fmt, gs):
    rng = np.random.default_rng(2)
    qw = quant.quantize(rng.standard_normal((20, 33)).astype(np.float32), fmt, group_size=gs)
    rows = np.array([3, 0, 19, 3])
    assert np.array_equal(quant.dequantize_rows(qw, rows), quant.dequantize(qw)[rows])
    with pytest.raises(IndexError):
        quant.dequantize_rows(qw, np.array([20]))


def test_dequantize_f32_and_bf16():
    w = torch.randn(4, 5)
    f = QuantWeight(WeightFormat.F32, (4, 5), w.numpy())
    assert np.array_equal(quant.dequantize(f), w.numpy())
    b = w.bfloat16()
    bits = b.view(torch.int16).numpy().view(np.uint16)
    qb = QuantWeight(WeightFormat.BF16, (4, 5), bits)
    assert np.array_equal(quant.dequantize(qb), b.float().numpy())
    assert np.array_equal(quant.dequantize_rows(qb, np.array([1])), b.float().numpy()[[1]])


# ---- FP8 / E8M0 decoding ----------------------------------------------------------


def test_e4m3fn_table_matches_torch_for_all_bytes():
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    nan = np.isnan(ref)
    assert np.flatnonzero(nan).tolist() == [0x7F, 0xFF]
    assert np.array_equal(np.isnan(quant.E4M3FN), nan)
    assert np.array_equal(quant.E4M3FN[~nan], ref[~nan])
    assert np.array_equal(np.signbit(quant.E4M3FN[~nan]), np.signbit(ref[~nan]))  # -0.0


def test_e8m0_matches_torch():
    raw = np.arange(256, dtype=np.uint8)
    ref = torch.from_numpy(raw).view(torch.float8_e8m0fnu).float().numpy()
    got = quant.e8m0_to_f32(raw)
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    ok = ~np.isnan(ref)
    assert np.array_equal(got[ok], ref[ok])


def test_fp8_block_dequant_matches_torch():
    torch.manual_seed(0)
    w = (torch.randn(200, 300) * 3).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3) + 0.01
    ref = w.float() * s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    raw = w.view(torch.uint8).numpy()
    got = quant.dequantize_fp8_blocks(raw, s.numpy())
    assert np.array_equal(got, ref.numpy())


# ---- containers -------------------------------------------------------------------


def test_container_tensors_shapes():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 130)).astype(np.float32)
    q8 = quant.container_tensors("x.weight", quant.quantize(w, WeightFormat.Q8))
    assert q8["x.weight"].dtype == np.uint8 and q8["x.weight"].shape == (6, 130)
    assert q8["x.weight.qs"].dtype == np.float32 and q8["x.weight.qs"].shape == (6,)
    q4 = quant.container_tensors("x.weight", quant.quantize(w, WeightFormat.Q4, 64))
    assert q4["x.weight"].shape == (6, 65) and q4["x.weight.qs"].shape == (6, 3)
    q4r = quant.container_tensors("x.weight", quant.quantize(w, WeightFormat.Q4, 0))
    assert q4r["x.weight.qs"].shape == (6,)
    with pytest.raises(ValueError):
        quant.container_tensors(
            "x", QuantWeight(WeightFormat.BF16, (1, 1), np.zeros((1, 1), np.uint16))
        )


def test_f32_to_bf16_rounds_to_nearest_even_like_torch():
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(4096).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 4096),
            # exact ties: the kept bit decides (even stays, odd rounds up)
            np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 0.0, -0.0], dtype=np.float32),
            np.array([2.0**-128, 1.5 * 2.0**-127, 6 * 2.0**100], dtype=np.float32),  # e2m1 x 2^k
        ]
    ).astype(np.float32)
    ours = quant.f32_to_bf16(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    assert quant.bf16_to_f32(ours[-3:]).tolist() == values[-3:].tolist()  # exact
