"""Correctness of every format x family x ISA against numpy references, plus input
validation and the build's error when no C compiler is available."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from colibrid.backends.base import KernelFamily
from colibrid.formats.weights import QuantWeight, WeightFormat

SHAPES = [(1, 1), (5, 16), (33, 24), (17, 40), (70, 64), (19, 129), (40, 300), (130, 1000)]


def _x(s: int, i: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((s, i), dtype=np.float32)


def _f32_tol(w64: np.ndarray, x: np.ndarray) -> np.ndarray:
    """1e-5 of the magnitude sum |W| |x| (the scale rounding errors live on)."""
    return 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w64).T) + 1e-30


@pytest.mark.parametrize("o,i", SHAPES)
def test_f32_family_matches_dequantised(kit, isa, fmt_gs, o, i):
    kit.isa_or_skip(isa)
    fmt, gs = fmt_gs
    if gs and gs >= i and gs != 6:
        pytest.skip("group larger than the row is covered by per-row")
    w = kit.make_weight(fmt, o, i, gs, seed=o * 7 + i)
    x = _x(3, i)
    kit.native.set_isa(isa)
    y = kit.native.matmul(w, x, kit.F32)
    w64 = kit.dequant64(w)
    ref = x.astype(np.float64) @ w64.T
    assert y.shape == (3, o) and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= _f32_tol(w64, x))


@pytest.mark.parametrize("o,i", SHAPES)
def test_i8_family_matches_numpy_model(kit, isa, fmt_gs, o, i):
    kit.isa_or_skip(isa)
    fmt, gs = fmt_gs
    w = kit.make_weight(fmt, o, i, gs, seed=o * 3 + i)
    x = _x(3, i, seed=2)
    kit.native.set_isa(isa)
    y = kit.native.matmul(w, x, kit.I8)
    if fmt in (WeightFormat.F32, WeightFormat.BF16):  # documented: runs the F32 arithmetic
        w64 = kit.dequant64(w)
        assert np.all(np.abs(y - x.astype(np.float64) @ w64.T) <= _f32_tol(w64, x))
    else:
        assert np.array_equal(y.view(np.uint32), kit.i8_model(w, x).view(np.uint32))


def test_i8_zero_row_and_one_d(kit):
    w = kit.make_weight(WeightFormat.Q4, 20, 64, 64)
    x = np.zeros(64, dtype=np.float32)
    y = kit.native.matmul(w, x, kit.I8)
    assert y.shape == (20,) and not np.any(y)
    out = np.empty(20, dtype=np.float32)
    x[3] = 1.5
    assert kit.native.matmul(w, x, kit.I8, out=out) is out


@pytest.mark.parametrize("family", [KernelFamily.F32, KernelFamily.I8])
def test_swiglu_matches_composition(kit, isa, family):
    kit.isa_or_skip(isa)
    kit.native.set_isa(isa)
    d, f = 64, 96
    gate = kit.make_weight(WeightFormat.Q4, f, d, 32, seed=1)
    up = kit.make_weight(WeightFormat.Q4, f, d, 32, seed=2)
    down = kit.make_weight(WeightFormat.Q8, d, f, 0, seed=3)
    x = _x(5, d)
    y = kit.native.expert_swiglu(gate, up, down, x, family)
    if family == KernelFamily.F32:
        g = x.astype(np.float64) @ kit.dequant64(gate).T
        u = x.astype(np.float64) @ kit.dequant64(up).T
        ref = (kit.silu(g) * u) @ kit.dequant64(down).T
        assert np.allclose(y, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    else:
        g = kit.i8_model(gate, x)
        u = kit.i8_model(up, x)
        h = (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)
        ref = kit.i8_model(down, h)
        # exp may differ from libm expf in the last bit; the int8 h absorbs most of it
        assert np.allclose(y, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())


def _q8(o: int, i: int) -> QuantWeight:
    return QuantWeight(WeightFormat.Q8, (o, i), np.zeros((o, i), np.int8), np.ones(o, np.float32))


@pytest.mark.parametrize(
    "make, x, match",
    [
        (lambda: _q8(4, 8), np.zeros((2, 9), np.float32), "shape"),
        (lambda: _q8(4, 8), np.zeros((2, 8), np.float64), "float32"),
        (lambda: _q8(4, 8), np.zeros((8, 2), np.float32).T, "C-contiguous"),
        (lambda: _q8(4, 8), np.zeros((2, 2, 8), np.float32), "1-D or 2-D"),
        (
            lambda: QuantWeight(WeightFormat.Q8, (4, 8), np.zeros((4, 8), np.int8), None),
            np.zeros(8, np.float32),
            "need scales",
        ),
        (
            lambda: QuantWeight(
                WeightFormat.Q8, (4, 8), np.zeros((4, 8), np.int8), np.ones(3, np.float32)
            ),
            np.zeros(8, np.float32),
            "scales",
        ),
        (
            lambda: QuantWeight(
                WeightFormat.Q4, (4, 8), np.zeros((4, 8), np.uint8), np.ones(4, np.float32)
            ),
            np.zeros(8, np.float32),
            "data",
        ),
        (
            lambda: QuantWeight(
                WeightFormat.Q4, (4, 8), np.zeros((4, 4), np.uint8), np.ones(4, np.float32), 3
            ),
            np.zeros(8, np.float32),
            "group_size",
        ),
        (
            lambda: QuantWeight(
                WeightFormat.Q4, (4, 8), np.zeros((4, 4), np.uint8), np.ones(4, np.float32), 4
            ),
            np.zeros(8, np.float32),
            "scales",
        ),
        (
            lambda: QuantWeight(WeightFormat.F32, (4, 8), np.zeros((4, 8), np.int8)),
            np.zeros(8, np.float32),
            "float32",
        ),
    ],
)
def test_validation(kit, make, x, match):
    with pytest.raises(ValueError, match=match):
        kit.native.matmul(make(), x, kit.F32)


def test_validation_out_and_family(kit):
    w = _q8(4, 8)
    with pytest.raises(ValueError, match="out"):
        kit.native.matmul(w, np.zeros(8, np.float32), kit.F32, out=np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="family"):
        kit.native.matmul(w, np.zeros(8, np.float32), "f32")
    with pytest.raises(ValueError, match="shapes disagree"):
        kit.native.expert_swiglu(w, w, w, np.zeros(8, np.float32), kit.F32)


def test_isa_and_threads_api(kit):
    nat = kit.native
    assert "ref" in nat.available_isas()
    assert nat.current_isa() in nat.available_isas()
    with pytest.raises(ValueError):
        nat.set_isa("bogus")
    for name in nat.ISA_NAMES:
        if name not in nat.available_isas():
            with pytest.raises(ValueError, match="not available"):
                nat.set_isa(name)
    with nat.use_isa("ref"):
        assert nat.current_isa() == "ref"
    nat.set_threads(1)
    assert nat.threads() == 1
    with pytest.raises(ValueError):
        nat.set_threads(0)


def test_membw_probe_positive(kit):
    assert kit.native.membw_probe(1 << 24, repeats=1) > 0.1


def test_missing_compiler_gives_clear_error(tmp_path):
    env = dict(os.environ, CC="/nonexistent/cc", COLIBRI_NATIVE_DIR=str(tmp_path))
    code = (
        "from colibrid.backends import native_build\n"
        "from colibrid.errors import NativeBuildError\n"
        "try:\n    native_build.build()\n"
        "except NativeBuildError as e:\n    print('ERR', e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip()
    assert line.startswith("ERR") and "C compiler" in line and "gcc" in line
    assert "\n" not in line


def test_gil_released(kit):
    """While one thread sits in a long kernel, Python code keeps running in another."""
    import threading
    import time

    nat = kit.native
    nat.set_threads(1)
    nat.set_isa("ref")
    w = kit.make_weight(WeightFormat.Q4, 512, 2048, 6)
    x = _x(32, 2048)
    t0 = time.perf_counter()
    nat.matmul(w, x, kit.F32)
    call = time.perf_counter() - t0
    th = threading.Thread(target=nat.matmul, args=(w, x, kit.F32))
    stamps = [time.perf_counter()]
    th.start()
    while th.is_alive():
        stamps.append(time.perf_counter())
    th.join()
    longest_gap = float(np.max(np.diff(stamps))) if len(stamps) > 1 else call
    assert call > 0.02, "workload too small to tell"
    assert longest_gap < 0.5 * call


def test_concurrent_builds_share_one_result(tmp_path):
    """Two processes building into an empty cache serialise on the lock: one build."""
    env = dict(os.environ, COLIBRI_NATIVE_DIR=str(tmp_path))
    code = "from colibrid.backends import native_build; print(native_build.build())"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    paths = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1
    built = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert len(built) == 1 and not any(".tmp" in d.name for d in tmp_path.iterdir())


def test_the_pool_counts_its_jobs_and_the_callers_wait():
    """What `bench decode` and `bench peer` report as the pool's wait: jobs run in parallel
    are counted, their time measured, the wait a part of it; a reset starts again."""
    from colibrid.backends import native
    from colibrid.formats.quant import quantize

    if native.threads() < 2:
        pytest.skip("one thread: no parallel jobs")
    w = quantize(_x(2048, 1024, seed=3), WeightFormat.Q4, 64)
    x = _x(1, 1024)
    native.pool_stats(reset=True)
    for _ in range(20):
        native.matmul(w, x, KernelFamily.F32)
    stats = native.pool_stats(reset=True)
    assert stats.jobs == 20 and stats.seconds > 0
    assert 0.0 <= stats.wait_s <= stats.seconds and 0.0 <= stats.wait_share < 1.0
    native.matmul(w, x, KernelFamily.F32)
    assert native.pool_stats().jobs == 1


@pytest.mark.parametrize("fmt", [WeightFormat.Q2, WeightFormat.Q3])
@pytest.mark.parametrize("o,i", [(19, 320), (33, 2048)])
def test_affine_f32_batch_rows_equal_rows_alone(kit, isa, fmt, o, i):
    """The Q2/Q3 F32 kernels pass over a weight row once for up to four activation rows;
    each row must still get exactly the bits it gets alone (batched == alone)."""
    kit.isa_or_skip(isa)
    w = kit.make_weight(fmt, o, i, 64, seed=o + i)
    x = _x(9, i, seed=5)
    kit.native.set_isa(isa)
    batch = kit.native.matmul(w, x, kit.F32)
    alone = np.stack([kit.native.matmul(w, x[k : k + 1], kit.F32)[0] for k in range(9)])
    assert np.array_equal(batch.view(np.uint32), alone.view(np.uint32))
