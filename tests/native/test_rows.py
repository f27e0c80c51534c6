"""The native row operations: RMSNorm close to numpy's (its own fixed sum order, each row
alone), the residual add fused in front of it bit-identical to the two apart, rotate_half
RoPE bit-identical to the numpy formula (partial rotation included), bad shapes refused."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.models.layers.norm import rms_norm as numpy_rms_norm
from colibrid.models.layers.rope import apply_half

native = pytest.importorskip("colibrid.backends.native")


@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (3, 4, 7), (2, 6144)])
def test_rms_norm_is_close_to_numpy_and_row_independent(shape) -> None:
    rng = np.random.default_rng(len(shape))
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    w = rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32)
    got = native.rms_norm(x, w, 1e-5)
    np.testing.assert_allclose(got, numpy_rms_norm(x, w, 1e-5), rtol=2e-6, atol=1e-7)
    rows = x.reshape(-1, shape[-1])
    flat = got.reshape(-1, shape[-1])
    for r in range(rows.shape[0]):
        one = native.rms_norm(np.ascontiguousarray(rows[r : r + 1]), w, 1e-5)
        assert np.array_equal(one[0].view(np.uint32), flat[r].view(np.uint32))


def test_add_rms_norm_equals_the_add_then_the_norm() -> None:
    rng = np.random.default_rng(7)
    h = rng.standard_normal((3, 200), dtype=np.float32)
    delta = rng.standard_normal((3, 200), dtype=np.float32)
    w = rng.uniform(0.5, 1.5, 200).astype(np.float32)
    total, normed = native.add_rms_norm(h, delta, w, 1e-6)
    assert np.array_equal(total.view(np.uint32), (h + delta).view(np.uint32))
    want = native.rms_norm(h + delta, w, 1e-6)
    assert np.array_equal(normed.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("rows,heads,d,half", [(1, 9, 64, 32), (4, 2, 64, 16), (3, 5, 10, 2)])
def test_rope_half_is_the_numpy_formula_bit_for_bit(rows, heads, d, half) -> None:
    rng = np.random.default_rng(d)
    x = rng.standard_normal((rows, heads, d), dtype=np.float32)
    angles = rng.uniform(0, 100, (rows, half)).astype(np.float32)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    got = native.rope_half(x, cos, sin)
    assert np.array_equal(got.view(np.uint32), apply_half(x, cos, sin).view(np.uint32))


def test_bad_shapes_are_refused() -> None:
    x = np.zeros((2, 3, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="rope shapes disagree"):
        native.rope_half(x, np.zeros((2, 5), np.float32), np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="cos"):
        native.rope_half(x, np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError, match="weight"):
        native.rms_norm(np.zeros((2, 8), np.float32), np.zeros(7, np.float32), 1e-6)
    with pytest.raises(ValueError, match="float32"):
        native.rms_norm(np.zeros((2, 8)), np.zeros(8, np.float32), 1e-6)
    with pytest.raises(ValueError, match="delta"):
        native.add_rms_norm(
            np.zeros((2, 8), np.float32), np.zeros((2, 7), np.float32), np.zeros(8, np.float32), 1
        )
