"""Batch independence: row s of an S-row call is bit-identical to a 1-row call on row
s, in both families, every format, every ISA, with 1 and 2 threads (the thread split
must not change bits either)."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.backends.base import KernelFamily
from colibrid.formats.weights import WeightFormat


@pytest.mark.parametrize("family", [KernelFamily.F32, KernelFamily.I8])
@pytest.mark.parametrize("nthreads", [1, 2])
# S spans several of the kernels' activation blocks (16 KB of rows: 32 f32 or 128 int8
# rows at I=100, 4 or 16 at I=1024), so block edges are crossed in both families.
@pytest.mark.parametrize("o,i,s", [(37, 100, 150), (300, 1024, 17)])
def test_rows_equal_single_calls(kit, isa, fmt_gs, family, nthreads, o, i, s):
    kit.isa_or_skip(isa)
    fmt, gs = fmt_gs
    kit.native.set_isa(isa)
    kit.native.set_threads(nthreads)
    w = kit.make_weight(fmt, o, i, gs, seed=o + i)
    x = np.random.default_rng(5).standard_normal((s, i), dtype=np.float32)
    batch = kit.native.matmul(w, x, family)
    singles = np.stack([kit.native.matmul(w, x[s], family) for s in range(x.shape[0])])
    assert np.array_equal(batch.view(np.uint32), singles.view(np.uint32))
    kit.native.set_threads(1 if nthreads == 2 else 2)
    other = kit.native.matmul(w, x, family)
    assert np.array_equal(batch.view(np.uint32), other.view(np.uint32))


@pytest.mark.parametrize("family", [KernelFamily.F32, KernelFamily.I8])
def test_swiglu_rows_equal_single_calls(kit, isa, family):
    kit.isa_or_skip(isa)
    kit.native.set_isa(isa)
    d, f = 128, 192
    gate = kit.make_weight(WeightFormat.Q4, f, d, 64, seed=1)
    up = kit.make_weight(WeightFormat.Q4, f, d, 64, seed=2)
    down = kit.make_weight(WeightFormat.Q8, d, f, 0, seed=3)
    x = np.random.default_rng(6).standard_normal((9, d), dtype=np.float32)
    batch = kit.native.expert_swiglu(gate, up, down, x, family)
    singles = np.stack([kit.native.expert_swiglu(gate, up, down, r, family) for r in x])
    assert np.array_equal(batch.view(np.uint32), singles.view(np.uint32))


@pytest.mark.parametrize("family", [KernelFamily.F32, KernelFamily.I8])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_blocks_equal_per_block_matmuls(kit, isa, fmt_gs, family, nthreads):
    """matmul_blocks (MLA's per-head products) = one matmul per block, bit for bit."""
    kit.isa_or_skip(isa)
    fmt, gs = fmt_gs
    kit.native.set_isa(isa)
    kit.native.set_threads(nthreads)
    blocks, rows, i = 24, 40, 192
    w = kit.make_weight(fmt, blocks * rows, i, gs, seed=11)
    x = np.random.default_rng(8).standard_normal((3, blocks, i), dtype=np.float32)
    y = kit.native.matmul_blocks(w, x, family)
    assert y.shape == (3, blocks * rows)
    for b in range(blocks):
        sub = type(w)(
            w.fmt,
            (rows, i),
            w.data[b * rows : (b + 1) * rows],
            None if w.scales is None else w.scales[b * rows : (b + 1) * rows],
            w.group_size,
        )
        want = kit.native.matmul(sub, np.ascontiguousarray(x[:, b]), family)
        got = y[:, b * rows : (b + 1) * rows]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), b
    one = kit.native.matmul_blocks(w, np.ascontiguousarray(x[1]), family)
    assert np.array_equal(one.view(np.uint32), y[1].view(np.uint32))
    with pytest.raises(ValueError, match="equal blocks"):
        kit.native.matmul_blocks(w, np.zeros((7, i), np.float32), family)
