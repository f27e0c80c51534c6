"""Shared helpers for the native kernel tests: random weights in every format, the
float64 dequantised reference, and a numpy model of the I8 family that reproduces the
portable C arithmetic bit for bit (same float32 operations in the same order)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from colibrid.backends.base import KernelFamily
from colibrid.formats.affine import AFFINE_GROUP, affine_groups, pack_affine, unpack_affine
from colibrid.formats.quant import FP4_VALUES, fp4_scales
from colibrid.formats.weights import AFFINE_FORMATS, QuantWeight, WeightFormat

native = pytest.importorskip("colibrid.backends.native")


def make_weight(fmt: WeightFormat, o: int, i: int, gs: int = 0, seed: int = 0) -> QuantWeight:
    """A random weight of shape [o, i]; Q4 (FP4) with odd i gets padding nibble 8 (0),
    the code of zero; FP4's scales are e8m0 bytes, as MXFP4's."""
    rng = np.random.default_rng(seed)
    if fmt == WeightFormat.F32:
        return QuantWeight(fmt, (o, i), rng.standard_normal((o, i), dtype=np.float32))
    if fmt == WeightFormat.BF16:
        f = rng.standard_normal((o, i), dtype=np.float32)
        return QuantWeight(fmt, (o, i), (f.view(np.uint32) >> 16).astype(np.uint16))
    if fmt in AFFINE_FORMATS:  # random codes, scales and (mostly negative) minimums
        groups = affine_groups(i)
        qmax = 3 if fmt == WeightFormat.Q2 else 7
        codes = rng.integers(0, qmax + 1, (o, groups * AFFINE_GROUP), dtype=np.uint8)
        codes[:, i:] = 0
        sm = np.empty((o, groups, 2), dtype=np.float16)
        sm[:, :, 0] = rng.uniform(0.001, 0.05, (o, groups))
        sm[:, :, 1] = rng.uniform(-0.1, 0.02, (o, groups))
        return QuantWeight(fmt, (o, i), pack_affine(codes, fmt), sm.reshape(o, -1), AFFINE_GROUP)
    if fmt == WeightFormat.Q8:
        q = rng.integers(-128, 128, (o, i), dtype=np.int8)
        s = rng.uniform(0.001, 0.02, o).astype(np.float32)
        return QuantWeight(fmt, (o, i), q, s)
    q = rng.integers(-8, 8, (o, i + (i & 1)), dtype=np.int64)
    if i & 1:
        q[:, -1] = 0 if fmt == WeightFormat.Q4 else -8  # code 0 is FP4's zero
    n = (q + 8).astype(np.uint8)
    data = np.ascontiguousarray(n[:, 0::2] | (n[:, 1::2] << 4))
    groups = 1 if gs == 0 else -(-i // gs)
    shape = (o,) if gs == 0 else (o, groups)
    if fmt == WeightFormat.FP4:  # e8m0 bytes: factors 2^-13 .. 2^-3
        s = rng.integers(115, 126, shape).astype(np.uint8)
    else:
        s = rng.uniform(0.001, 0.05, shape).astype(np.float32)
    return QuantWeight(fmt, (o, i), data, s, gs)


def q_values(w: QuantWeight) -> np.ndarray:
    """Integer weight codes as int64 [O, I] (Q8/Q4; FP4's code values)."""
    o, i = w.shape
    if w.fmt == WeightFormat.Q8:
        return w.data.astype(np.int64)
    if w.fmt in AFFINE_FORMATS:
        return unpack_affine(w.data, w.fmt, i).astype(np.int64)
    d = w.data.astype(np.int64)
    q = np.empty((o, d.shape[1] * 2), dtype=np.int64)
    q[:, 0::2] = d & 15
    q[:, 1::2] = d >> 4
    if w.fmt == WeightFormat.FP4:
        return FP4_VALUES[q[:, :i]].astype(np.int64)
    return q[:, :i] - 8


def group_scales(w: QuantWeight) -> tuple[np.ndarray, int]:
    """Scales as [O, G] float32 and the group length in elements."""
    o, i = w.shape
    if w.fmt in AFFINE_FORMATS:  # the scale of each (s, m) pair
        return w.scales.reshape(o, -1, 2)[:, :, 0].astype(np.float32), AFFINE_GROUP
    scales = fp4_scales(w.scales) if w.fmt == WeightFormat.FP4 else w.scales
    if w.fmt == WeightFormat.Q8 or w.group_size == 0 or w.group_size >= i:
        return scales.reshape(o, 1), i
    return scales.reshape(o, -1), w.group_size


def dequant64(w: QuantWeight) -> np.ndarray:
    """The dequantised weight in float64 (W[o, i] = q * s as the kernels define it)."""
    o, i = w.shape
    if w.fmt == WeightFormat.F32:
        return w.data.astype(np.float64)
    if w.fmt == WeightFormat.BF16:
        return (w.data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    s, gsz = group_scales(w)
    scaled = q_values(w) * np.repeat(s, gsz, axis=1)[:, :i].astype(np.float64)
    if w.fmt in AFFINE_FORMATS:  # plus each group's minimum
        m = w.scales.reshape(o, -1, 2)[:, :, 1].astype(np.float64)
        scaled += np.repeat(m, gsz, axis=1)[:, :i]
    return scaled


def quant_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 activation quantisation exactly as colibri_quant_row: absmax/127, rint."""
    amax = np.abs(x).max(axis=1).astype(np.float32)
    xs = (amax / np.float32(127)).astype(np.float32)
    q = np.zeros(x.shape, dtype=np.int64)
    nz = xs > 0
    v = (x[nz] / xs[nz, None]).astype(np.float32)
    q[nz] = np.rint(np.clip(v, -127, 127)).astype(np.int64)
    return q, xs


def i8_model(w: QuantWeight, x: np.ndarray) -> np.ndarray:
    """numpy model of the I8 family, bit-identical to the portable C reference."""
    o, i = w.shape
    qx, xs = quant_rows(x)
    qw = q_values(w)
    s, gsz = group_scales(w)
    acc = np.zeros((x.shape[0], o), dtype=np.float32)
    affine = w.fmt in AFFINE_FORMATS
    m = w.scales.reshape(o, -1, 2)[:, :, 1].astype(np.float32) if affine else None
    for g in range(s.shape[1]):
        sl = slice(g * gsz, min(i, (g + 1) * gsz))
        isum = (qx[:, sl] @ qw[:, sl].T).astype(np.float32)
        t = (s[:, g][None, :] * xs[:, None]).astype(np.float32)
        part = (isum * t).astype(np.float32)
        if affine:  # acc + ((float)isum * (s * xs) + (float)xsum * (m * xs))
            xsum = qx[:, sl].sum(axis=1).astype(np.float32)[:, None]
            tm = (m[:, g][None, :] * xs[:, None]).astype(np.float32)
            part = (part + (xsum * tm).astype(np.float32)).astype(np.float32)
        acc = (acc + part).astype(np.float32)
    return acc


def silu(g: np.ndarray) -> np.ndarray:
    return g / (1.0 + np.exp(-g))


def isa_or_skip(name: str) -> None:
    if name not in native.available_isas():
        pytest.skip(f"ISA {name} not available on this CPU")


ALL_ISAS = ["ref", "avx2", "avx512vnni", "neon"]

FORMATS = [
    (WeightFormat.F32, 0),
    (WeightFormat.BF16, 0),
    (WeightFormat.Q8, 0),
    (WeightFormat.Q4, 0),
    (WeightFormat.Q4, 64),
    (WeightFormat.Q4, 32),
    (WeightFormat.Q4, 128),
    (WeightFormat.Q4, 6),
    (WeightFormat.FP4, 32),
    (WeightFormat.FP4, 6),
    (WeightFormat.Q2, 64),
    (WeightFormat.Q3, 64),
]


@pytest.fixture
def kit() -> types.SimpleNamespace:
    """The helpers above, as a fixture (tests import no conftest module by name)."""
    return types.SimpleNamespace(
        native=native,
        make_weight=make_weight,
        dequant64=dequant64,
        quant_rows=quant_rows,
        i8_model=i8_model,
        silu=silu,
        isa_or_skip=isa_or_skip,
        F32=KernelFamily.F32,
        I8=KernelFamily.I8,
    )


@pytest.fixture(autouse=True)
def _restore_isa_and_threads():
    """Tests switch ISA/threads freely; put the process defaults back afterwards."""
    isa, nt = native.isa_setting(), native.threads()
    yield
    native.set_isa(isa)
    native.set_threads(nt)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise `isa` over every ISA (unavailable ones skip) and `fmt_gs` over formats."""
    if "isa" in metafunc.fixturenames:
        metafunc.parametrize("isa", ALL_ISAS)
    if "fmt_gs" in metafunc.fixturenames:
        metafunc.parametrize("fmt_gs", FORMATS, ids=[f"{f.value}-g{g}" for f, g in FORMATS])
