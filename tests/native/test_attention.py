"""The native grouped-query attention: close to a float64 softmax reference, causal, each
row computed alone (S rows equal S one-row calls bit for bit, the property batched decode
relies on), the same bits on every thread count, and bad shapes refused before C runs."""

from __future__ import annotations

import numpy as np
import pytest

native = pytest.importorskip("colibrid.backends.native")

CASES = [  # S, H, G, d, T
    (1, 9, 3, 64, 300),
    (1, 4, 4, 48, 1),
    (5, 4, 2, 48, 12),
    (7, 8, 8, 16, 7),
    (3, 6, 1, 20, 40),
    (16, 8, 2, 13, 16),
]


def _inputs(s: int, h: int, g: int, d: int, t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((s, h, d), dtype=np.float32)
    cache = rng.standard_normal((t + 3, g, d), dtype=np.float32) * 2  # a cache's rows
    values = rng.standard_normal((t + 3, g, d), dtype=np.float32)
    return q, cache[:t], values[:t]


def _reference(q, keys, values, scale: float, start: int, window: int | None = None, sinks=None):
    s, h, d = q.shape
    group = h // keys.shape[1]
    out = np.zeros((s, h, d))
    for row in range(s):
        visible = start + row + 1
        first = 0 if window is None else max(0, visible - window)
        for head in range(h):
            k = keys[first:visible, head // group].astype(np.float64)
            v = values[first:visible, head // group].astype(np.float64)
            scores = k @ q[row, head].astype(np.float64) * scale
            top = scores.max() if sinks is None else max(scores.max(), float(sinks[head]))
            p = np.exp(scores - top)
            total = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[head]) - top))
            out[row, head] = (p / total) @ v
    return out.reshape(s, h * d)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [None, 5])
def test_sinks_join_the_softmax_rows_alone_every_isa(case: tuple[int, ...], window) -> None:
    """gpt-oss's sinks: close to the float64 rule; S rows equal one-row calls; every ISA
    gives the same bits; without sinks the bits are those of the plain kernel."""
    s, h, g, d, t = case
    q, keys, values = _inputs(s, h, g, d, t, seed=4)
    sinks = np.linspace(-2.0, 6.0, h, dtype=np.float32)
    start = t - s
    got = native.attend_gqa(q, keys, values, d**-0.5, start, window, sinks)
    want = _reference(q, keys, values, d**-0.5, start, window, sinks)
    np.testing.assert_allclose(got, want, atol=2e-6)
    for row in range(s):
        end = start + row + 1
        one = native.attend_gqa(
            q[row : row + 1], keys[:end], values[:end], d**-0.5, start + row, window, sinks
        )
        assert np.array_equal(got[row : row + 1], one)
    for isa in native.available_isas():
        with native.use_isa(isa):
            again = native.attend_gqa(q, keys, values, d**-0.5, start, window, sinks)
            assert np.array_equal(again.view(np.uint32), got.view(np.uint32)), isa
    with pytest.raises(ValueError, match="sinks"):
        native.attend_gqa(q, keys, values, 1.0, start, window, sinks[:-1])


@pytest.mark.parametrize("case", CASES)
def test_matches_the_float64_reference(case: tuple[int, ...]) -> None:
    s, h, g, d, t = case
    q, keys, values = _inputs(s, h, g, d, t)
    got = native.attend_gqa(q, keys, values, d**-0.5, t - s)
    assert got.shape == (s, h * d) and got.dtype == np.float32
    np.testing.assert_allclose(got, _reference(q, keys, values, d**-0.5, t - s), atol=2e-6)


@pytest.mark.parametrize("case", CASES)
def test_rows_equal_one_row_calls_and_threads_change_nothing(case: tuple[int, ...]) -> None:
    s, h, g, d, t = case
    q, keys, values = _inputs(s, h, g, d, t, seed=1)
    start = t - s
    batch = native.attend_gqa(q, keys, values, 0.3, start)
    for row in range(s):
        end = start + row + 1
        one = native.attend_gqa(q[row : row + 1], keys[:end], values[:end], 0.3, start + row)
        assert np.array_equal(batch[row : row + 1], one)
    threads = native.threads()
    try:
        native.set_threads(1)
        assert np.array_equal(batch, native.attend_gqa(q, keys, values, 0.3, start))
    finally:
        native.set_threads(threads)


def test_a_row_never_sees_a_later_key() -> None:
    q, keys, values = _inputs(4, 4, 2, 8, 10)
    before = native.attend_gqa(q, keys, values, 0.5, 6)
    keys2, values2 = keys.copy(), values.copy()
    keys2[8:] += 100.0  # only rows 2 and 3 (positions 8, 9) may see these
    values2[8:] -= 50.0
    after = native.attend_gqa(q, keys2, values2, 0.5, 6)
    assert np.array_equal(before[:2], after[:2])
    assert not np.allclose(before[2:], after[2:])


@pytest.mark.parametrize("window", [1, 3, 8, 14, 40])
def test_a_sliding_window_is_attention_over_the_last_keys_only(window: int) -> None:
    """With a window W the row at position p sees keys p - W < t <= p: close to the float64
    reference, and bit for bit the unwindowed kernel run on just those keys."""
    s, h, g, d, t = 6, 4, 2, 16, 20
    q, keys, values = _inputs(s, h, g, d, t, seed=4)
    start = t - s
    got = native.attend_gqa(q, keys, values, 0.25, start, window)
    np.testing.assert_allclose(got, _reference(q, keys, values, 0.25, start, window), atol=2e-6)
    for row in range(s):
        end = start + row + 1
        first = max(0, end - window)
        alone = native.attend_gqa(
            q[row : row + 1], keys[first:end], values[first:end], 0.25, end - first - 1
        )
        assert np.array_equal(got[row : row + 1], alone)
    if window >= t:
        assert np.array_equal(got, native.attend_gqa(q, keys, values, 0.25, start))
    else:
        assert not np.allclose(got, native.attend_gqa(q, keys, values, 0.25, start))
    for isa in native.available_isas():
        with native.use_isa(isa):
            again = native.attend_gqa(q, keys, values, 0.25, start, window)
        assert np.array_equal(again.view(np.uint32), got.view(np.uint32)), isa


@pytest.mark.parametrize("window", [0, -2, 2.5, True])
def test_a_window_must_be_a_positive_count(window) -> None:
    q, keys, values = _inputs(1, 2, 1, 8, 4)
    with pytest.raises(ValueError, match="window"):
        native.attend_gqa(q, keys, values, 1.0, 3, window)


@pytest.mark.parametrize(
    ("q_shape", "kv_shape", "start", "message"),
    [
        ((1, 6, 8), (5, 4, 8), 4, "shapes disagree"),  # 6 heads do not group over 4
        ((2, 4, 8), (5, 2, 8), 4, "shapes disagree"),  # rows past the cache
        ((1, 4, 8), (5, 2, 7), 4, "values has shape"),
        ((4, 8), (5, 2, 8), 4, "3-D"),
    ],
)
def test_bad_shapes_are_refused(q_shape, kv_shape, start, message) -> None:
    q = np.zeros(q_shape, dtype=np.float32)
    keys = np.zeros((5, 2, 8) if message == "values has shape" else kv_shape, dtype=np.float32)
    values = np.zeros(kv_shape, dtype=np.float32)
    with pytest.raises(ValueError, match=message):
        native.attend_gqa(q, keys, values, 1.0, start)


@pytest.mark.parametrize("case", CASES + [(2, 6, 3, 100, 37)])
def test_every_isa_gives_the_same_bits(case: tuple[int, ...]) -> None:
    """The four-lane portable build and the eight-lane AVX2 build share one arithmetic
    (same partial sums, same exp), so switching ISA never changes an attention output."""
    s, h, g, d, t = case
    q, keys, values = _inputs(s, h, g, d, t, seed=3)
    outputs = {}
    for isa in native.available_isas():
        with native.use_isa(isa):
            outputs[isa] = native.attend_gqa(q, keys, values, d**-0.5, t - s)
    first = next(iter(outputs.values()))
    for isa, out in outputs.items():
        assert np.array_equal(out.view(np.uint32), first.view(np.uint32)), isa


def test_softmax_weights_far_below_the_maximum_are_zero_not_garbage() -> None:
    """Scores more than 87 below a row's maximum take the exp's zero branch: the output is
    then exactly the value of the dominant key."""
    q = np.zeros((1, 1, 8), dtype=np.float32)
    q[0, 0, 0] = 1.0
    keys = np.zeros((12, 1, 8), dtype=np.float32)
    keys[:, 0, 0] = -1000.0
    keys[5, 0, 0] = 1000.0
    values = np.arange(12 * 8, dtype=np.float32).reshape(12, 1, 8)
    out = native.attend_gqa(q, keys, values, 1.0, 11)
    assert np.array_equal(out[0], values[5, 0])
