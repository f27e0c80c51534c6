"""SamplingParams validation and the seeded Sampler."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from colibrid.engine.sampling import Sampler, SamplingError, SamplingParams
from colibrid.errors import ColibriError, RequestError


def test_defaults_are_greedy():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (
        256,
        0.0,
        1.0,
        0,
        None,
        (),
    )
    assert p.greedy


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.0}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"stop": "abc"}, "list of strings"),
        ({"stop": ("",)}, "non-empty"),
        ({"stop": (1,)}, "non-empty"),
        ({"stop": tuple("abcdefghijklmnopq")}, "at most 16"),
    ],
)
def test_invalid_params(kwargs, match):
    with pytest.raises(RequestError, match=match):
        SamplingParams(**kwargs)


def test_stop_list_becomes_tuple_and_numbers_normalise():
    p = SamplingParams(stop=["a", "b"], temperature=1, top_p=np.float32(0.5), seed=np.int64(3))
    assert p.stop == ("a", "b") and isinstance(p.temperature, float)
    assert hash(p)  # frozen and hashable


def test_greedy_argmax_lowest_index_on_ties():
    s = Sampler(SamplingParams())
    assert s.sample(np.array([0, 3, 1, 3], np.float32)) == 1
    assert s.sample(np.array([-np.inf, -5, -np.inf], np.float32)) == 1


@pytest.mark.parametrize(
    "logits",
    [
        [0.0, np.nan, 1.0],
        [0.0, np.inf],
        [-np.inf, -np.inf],
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_raise(logits, temperature):
    s = Sampler(SamplingParams(temperature=temperature, seed=0))
    with pytest.raises(SamplingError, match="non-finite") as info:
        s.sample(np.array(logits, np.float32))
    assert isinstance(info.value, ColibriError)


def test_bad_shape_raises():
    with pytest.raises(SamplingError):
        Sampler(SamplingParams()).sample(np.zeros((2, 3), np.float32))


def test_same_seed_same_tokens():
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((50, 1000)).astype(np.float32)
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    s1, s2 = Sampler(p), Sampler(p)
    t1 = [s1.sample(r) for r in rows]
    t2 = [s2.sample(r) for r in rows]
    assert t1 == t2 and len(set(t1)) > 5
    s3 = Sampler(SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1235))
    assert [s3.sample(r) for r in rows] != t1


def test_top_k_one_and_tiny_temperature_are_argmax():
    rng = np.random.default_rng(2)
    for _ in range(20):
        row = rng.standard_normal(300).astype(np.float32)
        assert Sampler(SamplingParams(temperature=5.0, top_k=1, seed=0)).sample(row) == row.argmax()
        assert Sampler(SamplingParams(temperature=1e-30, seed=0)).sample(row) == row.argmax()


def test_top_k_ties_keep_lowest_indices():
    row = np.array([1.0, 2.0, 2.0, 2.0, 0.0], np.float32)
    seen = {
        Sampler(SamplingParams(temperature=1.0, top_k=2, seed=s)).sample(row) for s in range(200)
    }
    assert seen == {1, 2}


def test_top_p_keeps_smallest_nucleus():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    row = np.log(probs).astype(np.float32)
    for top_p, allowed in [(0.5, {0}), (0.55, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2})]:
        seen = {
            Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=s)).sample(row)
            for s in range(300)
        }
        assert seen == allowed, top_p


def test_distribution_matches_softmax():
    row = np.array([0.0, 1.0, 2.0], np.float32)
    s = Sampler(SamplingParams(temperature=1.0, seed=7))
    counts = np.bincount([s.sample(row) for _ in range(20000)], minlength=3) / 20000
    expect = np.exp(row) / np.exp(row).sum()
    assert np.abs(counts - expect).max() < 0.015


@settings(max_examples=100, deadline=None)
@given(
    row=arrays(
        np.float32, st.integers(1, 64), elements=st.floats(-50, 50, width=32) | st.just(-np.inf)
    ),
    temperature=st.floats(0.0, 4.0),
    top_p=st.floats(0.01, 1.0),
    top_k=st.integers(0, 10),
    seed=st.integers(0, 2**32),
)
def test_sample_is_a_valid_finite_token(row, temperature, top_p, top_k, seed):
    if not np.isfinite(row).any():
        row[0] = 0.0
    p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    token = Sampler(p).sample(row)
    assert 0 <= token < row.size and np.isfinite(row[token])
    assert Sampler(p).sample(row) == token
    if top_k:
        assert row[token] >= np.sort(row)[::-1][min(top_k, row.size) - 1]
