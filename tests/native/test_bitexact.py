"""Integer kernels are bit-exact across ISAs: every SIMD path equals the portable C
reference byte for byte (docs/architecture.md), including tails, odd I and batched rows."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.backends.base import KernelFamily
from colibrid.formats.weights import WeightFormat

INTEGER = [
    (WeightFormat.Q8, 0),
    (WeightFormat.Q4, 0),
    (WeightFormat.Q4, 64),
    (WeightFormat.Q4, 32),
    (WeightFormat.Q4, 96),
    (WeightFormat.Q4, 256),
    (WeightFormat.Q4, 10),
    (WeightFormat.Q2, 64),
    (WeightFormat.Q3, 64),
]
SHAPES = [
    (1, 1),
    (7, 63),
    (16, 64),
    (17, 100),
    (33, 129),
    (40, 192),
    (64, 257),
    (5, 1000),
    (48, 2048),
]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("fmt,gs", INTEGER, ids=[f"{f.value}-g{g}" for f, g in INTEGER])
@pytest.mark.parametrize("o,i", SHAPES)
@pytest.mark.parametrize("s", [1, 3, 17])
def test_matmul_i8_bitexact(kit, isa, fmt, gs, o, i, s):
    if isa == "ref":
        pytest.skip("ref is the oracle")
    kit.isa_or_skip(isa)
    w = kit.make_weight(fmt, o, i, gs, seed=o + 31 * i + s)
    rng = np.random.default_rng(s)
    x = rng.standard_normal((s, i), dtype=np.float32) * rng.uniform(0.01, 100.0, (s, 1)).astype(
        np.float32
    )
    x[0, :] = np.round(x[0, :])  # exact ties: exercise round-half-to-even
    if s > 2:
        x[2, :] = 0.0  # an all-zero row
    with kit.native.use_isa("ref"):
        ref = kit.native.matmul(w, x, KernelFamily.I8)
    with kit.native.use_isa(isa):
        got = kit.native.matmul(w, x, KernelFamily.I8)
    assert _same_bits(got, ref)


@pytest.mark.parametrize("s", [1, 3, 17])
def test_swiglu_i8_bitexact(kit, isa, s):
    if isa == "ref":
        pytest.skip("ref is the oracle")
    kit.isa_or_skip(isa)
    d, f = 96, 160
    gate = kit.make_weight(WeightFormat.Q4, f, d, 32, seed=1)
    up = kit.make_weight(WeightFormat.Q4, f, d, 32, seed=2)
    down = kit.make_weight(WeightFormat.Q4, d, f, 32, seed=3)
    x = np.random.default_rng(s).standard_normal((s, d), dtype=np.float32)
    with kit.native.use_isa("ref"):
        ref = kit.native.expert_swiglu(gate, up, down, x, KernelFamily.I8)
    with kit.native.use_isa(isa):
        got = kit.native.expert_swiglu(gate, up, down, x, KernelFamily.I8)
    assert _same_bits(got, ref)


def test_ref_matches_numpy_model_large(kit):
    """The numpy model of the I8 arithmetic equals the C reference at a real size."""
    w = kit.make_weight(WeightFormat.Q4, 256, 2048, 64, seed=9)
    x = np.random.default_rng(9).standard_normal((2, 2048), dtype=np.float32)
    with kit.native.use_isa("ref"):
        got = kit.native.matmul(w, x, KernelFamily.I8)
    assert _same_bits(got, kit.i8_model(w, x))


hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


@hypothesis.settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(
    o=st.integers(1, 40),
    i=st.integers(1, 700),
    s=st.integers(1, 5),
    fmt_gs=st.sampled_from(INTEGER),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_bitexact_property(kit, o, i, s, fmt_gs, scale, seed):
    """Random shapes, group sizes and activation ranges: every ISA equals ref."""
    fmt, gs = fmt_gs
    w = kit.make_weight(fmt, o, i, gs, seed=seed)
    x = np.random.default_rng(seed).standard_normal((s, i), dtype=np.float32) * np.float32(scale)
    with kit.native.use_isa("ref"):
        ref = kit.native.matmul(w, x, KernelFamily.I8)
    for isa in kit.native.available_isas():
        with kit.native.use_isa(isa):
            assert _same_bits(kit.native.matmul(w, x, KernelFamily.I8), ref), isa
