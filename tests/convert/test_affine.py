"""The low-bit affine format (Q2/Q3, docs/formats.md): the numpy reference's quantisation
round trip, its bit layout, and a container that holds it read back as written."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from colibrid.formats import quant
from colibrid.formats.affine import (
    AFFINE_GROUP,
    affine_groups,
    bits_per_weight,
    pack_affine,
    unpack_affine,
)
from colibrid.formats.weights import QuantWeight, WeightFormat
from colibrid.store.container_format import (
    INT2_AFFINE,
    INT3_AFFINE,
    container_candidates,
    resolve_container_format,
)

AFFINE = [WeightFormat.Q2, WeightFormat.Q3]
QMAX = {WeightFormat.Q2: 3, WeightFormat.Q3: 7}

weights = hnp.arrays(
    np.float32,
    st.tuples(st.integers(1, 4), st.integers(1, 200)),
    elements=st.floats(-8, 8, width=32),
)


def _groups(w: np.ndarray):
    """(group slice, its elements) for every row and group of w."""
    for r in range(w.shape[0]):
        for g in range(affine_groups(w.shape[1])):
            sl = slice(g * AFFINE_GROUP, min(w.shape[1], (g + 1) * AFFINE_GROUP))
            yield r, g, w[r, sl]


@pytest.mark.parametrize("fmt", AFFINE, ids=lambda f: f.value)
@settings(max_examples=60, deadline=None)
@given(w=weights)
def test_round_trip_error_is_within_half_a_step_of_each_group(fmt, w):
    """Each dequantised weight lies within half a step (plus the float16 rounding of the
    minimum and scale) of the original, and inside the group's [min, max] up to that."""
    qw = quant.quantize(w, fmt)
    back = quant.dequantize(qw)
    assert back.shape == w.shape and back.dtype == np.float32
    sm = qw.scales.reshape(w.shape[0], -1, 2).astype(np.float32)
    for r, g, group in _groups(w):
        s, m = sm[r, g]
        lo, hi = float(group.min()), float(group.max())
        # float16 keeps 11 significant bits: m is off by <= |lo| 2^-11, s by <= s 2^-11,
        # which moves the top code by <= qmax * s 2^-11
        slack = abs(lo) * 2**-10 + QMAX[fmt] * s * 2**-10 + 1e-6 * (1 + abs(hi))
        sl = slice(g * AFFINE_GROUP, g * AFFINE_GROUP + len(group))
        err = np.abs(back[r, sl] - group)
        assert err.max() <= s / 2 + slack + (hi - lo) * 2**-10, (r, g, s, m)


@pytest.mark.parametrize("fmt", AFFINE, ids=lambda f: f.value)
@given(
    value=st.floats(-1000, 1000, width=32),
    cols=st.integers(1, 300),
)
def test_constant_groups_come_back_at_least_as_close_as_float16(fmt, value, cols):
    """A constant group: exact (s = 0, codes 0) when float16 holds the value, else no
    farther from it than float16's own rounding (the scale makes up part of it)."""
    w = np.full((2, cols), value, dtype=np.float32)
    qw = quant.quantize(w, fmt)
    back = quant.dequantize(qw)
    f16_err = abs(float(np.float16(value)) - value)
    assert np.abs(back - w).max() <= f16_err
    if f16_err == 0:
        assert (qw.scales.reshape(2, -1, 2)[:, :, 0] == 0).all()
        assert (unpack_affine(qw.data, fmt, cols) == 0).all()


@pytest.mark.parametrize("fmt", AFFINE, ids=lambda f: f.value)
def test_all_zero_weight_is_exact(fmt):
    w = np.zeros((3, 130), dtype=np.float32)
    qw = quant.quantize(w, fmt)
    assert np.array_equal(quant.dequantize(qw), w)
    assert not np.signbit(quant.dequantize(qw)).any()


@pytest.mark.parametrize("fmt", AFFINE, ids=lambda f: f.value)
def test_ragged_last_group_uses_its_own_range_and_pads_with_code_zero(fmt):
    """I = 70: the last group is 6 inputs wide; its scale comes from those six alone
    (a huge value in the first group does not coarsen it) and its padding codes are 0."""
    rng = np.random.default_rng(3)
    w = rng.uniform(-0.01, 0.01, (2, 70)).astype(np.float32)
    w[:, 0] = 500.0
    qw = quant.quantize(w, fmt)
    sm = qw.scales.reshape(2, 2, 2).astype(np.float32)
    assert (sm[:, 1, 0] <= np.float32(0.02 / QMAX[fmt] * 1.01)).all()
    blocks = qw.data.reshape(2, 2, -1)
    codes = unpack_affine(qw.data, fmt, 128)
    assert (codes[:, 70:] == 0).all() and blocks.shape[2] == (16 if fmt is WeightFormat.Q2 else 24)
    tail = np.abs(quant.dequantize(qw)[:, 64:] - w[:, 64:])
    assert tail.max() <= sm[:, 1, 0].max() / 2 + 1e-5


@pytest.mark.parametrize("fmt", AFFINE, ids=lambda f: f.value)
@given(data=st.data())
def test_pack_unpack_are_inverse(fmt, data):
    rows, groups = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    codes = data.draw(
        hnp.arrays(np.uint8, (rows, groups * AFFINE_GROUP), elements=st.integers(0, QMAX[fmt]))
    )
    packed = pack_affine(codes, fmt)
    assert packed.shape == (rows, groups * (16 if fmt is WeightFormat.Q2 else 24))
    assert np.array_equal(unpack_affine(packed, fmt, groups * AFFINE_GROUP), codes)


def test_the_documented_bit_layout():
    """Input 16k + j's low bits at bits 2k of byte j; Q3's bit 2 of input 8b + j at bit b
    of byte 16 + j (docs/formats.md)."""
    codes = np.zeros((1, 64), dtype=np.uint8)
    codes[0, 16 * 2 + 5] = 3  # k = 2, j = 5
    codes[0, 8 * 6 + 3] = 4  # Q3 high bit: b = 6, j = 3
    q3 = pack_affine(codes, WeightFormat.Q3)[0]
    assert q3[5] == 3 << 4 and q3[16 + 3] == 1 << 6
    assert np.count_nonzero(q3) == 2
    q2 = pack_affine(codes & 3, WeightFormat.Q2)[0]
    assert q2[5] == 3 << 4 and np.count_nonzero(q2) == 1


def test_rounding_is_half_to_even_and_sizes_are_as_documented():
    # group [0, 1, ..., 6] scaled: min 0, s = 1 for Q3; 2.5 lies on a tie -> 2 (even)
    w = np.array([[0, 7, 2.5, 3.5] + [0] * 60], dtype=np.float32)
    codes = unpack_affine(quant.quantize(w, WeightFormat.Q3).data, WeightFormat.Q3, 64)[0]
    assert list(codes[:4]) == [0, 7, 2, 4]
    assert bits_per_weight(WeightFormat.Q2) == 2.5 and bits_per_weight(WeightFormat.Q3) == 3.5


def test_non_finite_and_float16_overflow_are_refused():
    with pytest.raises(ValueError, match="non-finite"):
        quant.quantize(np.array([[np.nan, 1.0]], dtype=np.float32), WeightFormat.Q2)
    with pytest.raises(ValueError, match="float16"):
        quant.quantize(np.array([[-1e6, 1e6]], dtype=np.float32), WeightFormat.Q3)


@pytest.mark.parametrize(
    "fmt,name", [(WeightFormat.Q2, INT2_AFFINE), (WeightFormat.Q3, INT3_AFFINE)]
)
@pytest.mark.parametrize("shape", [(4, 64), (3, 100), (2, 1)])
def test_container_sizes_name_one_format(fmt, name, shape):
    """F16 scales and the block bytes tell each affine format from every other one, with
    no stamp needed."""
    qw = quant.quantize(np.ones(shape, dtype=np.float32), fmt)
    tensors = quant.container_tensors("w", qw)
    assert tensors["w"].dtype == np.uint8 and tensors["w.qs"].dtype == np.float16
    found = container_candidates(shape, tensors["w"].nbytes, tensors["w.qs"].size, "F16", None)
    assert [f.name for f in found] == [name]
    assert (
        resolve_container_format("w", shape, tensors["w"].nbytes, tensors["w.qs"].size, "F16").name
        == name
    )


def test_a_container_with_mixed_formats_reads_back_each_weight(tmp_path):
    """One file holding int4-g64, Q3 and Q2 matrices of one shape (experts in different
    formats): each reads back as the weight written, bytes and scales."""
    from safetensors.numpy import save_file

    from colibrid.store.checkpoint import Checkpoint

    rng = np.random.default_rng(0)
    written = {
        "e0": quant.quantize(rng.standard_normal((8, 96)).astype(np.float32), WeightFormat.Q4),
        "e1": quant.quantize(rng.standard_normal((8, 96)).astype(np.float32), WeightFormat.Q3),
        "e2": quant.quantize(rng.standard_normal((8, 96)).astype(np.float32), WeightFormat.Q2),
    }
    tensors: dict[str, np.ndarray] = {}
    for name, w in written.items():
        tensors.update(quant.container_tensors(name, w))
    save_file(tensors, str(tmp_path / "out-00000.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    with Checkpoint.open(tmp_path) as ckpt:
        for name, w in written.items():
            got = ckpt.weight(name, (8, 96))
            assert isinstance(got, QuantWeight) and got.fmt is w.fmt
            assert np.array_equal(got.data, w.data) and np.array_equal(got.scales, w.scales)
            assert np.array_equal(quant.dequantize(got), quant.dequantize(w))
