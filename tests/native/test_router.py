"""The native router, sigmoid and softmax, against the numpy rule (`route_reference`): the
same experts in the same order (group limit, bias, ties to the lowest index) and the same
gates up to float rounding; each row alone; bad arguments refused before C runs."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.backends.base import RouteRule
from colibrid.models.layers.router import route_reference

native = pytest.importorskip("colibrid.backends.native")

CASES = [  # S, D, E, n_group, topk_group, K, n, bias, norm, scaling, softmax
    (1, 576, 16, 1, 1, 4, 4, False, True, 1.0, False),
    (3, 64, 32, 4, 2, 4, 6, True, True, 2.5, False),
    (5, 100, 256, 8, 4, 8, 12, True, True, 2.5, False),
    (2, 24, 8, 2, 1, 2, 3, True, False, 1.0, False),
    (4, 33, 12, 3, 3, 3, 12, False, True, 1.0, False),
    # softmax scores (Qwen3-MoE, Mixtral, OLMoE): normalised top-k or raw probabilities
    (1, 2048, 128, 1, 1, 8, 8, False, True, 1.0, True),
    (6, 64, 8, 1, 1, 2, 2, False, True, 1.0, True),
    (3, 48, 64, 1, 1, 8, 16, False, False, 1.0, True),
    (2, 24, 12, 3, 2, 3, 5, True, True, 2.0, True),
]


@pytest.mark.parametrize("case", CASES)
def test_matches_the_numpy_rule(case) -> None:
    s, d, e, n_group, topk_group, k, n, with_bias, norm, scaling, softmax = case
    rng = np.random.default_rng(e + s)
    h = rng.standard_normal((s, d), dtype=np.float32)
    w = rng.standard_normal((e, d), dtype=np.float32) * 0.2
    bias = rng.standard_normal(e).astype(np.float32) * 0.1 if with_bias else None
    rule = RouteRule(k, n_group, topk_group, norm, scaling, softmax)
    ids, gates = native.route(h, w, bias, rule, n)
    want_ids, want_gates = route_reference(h, w, bias, rule, n)
    assert ids.dtype == np.int64 and ids.shape == (s, n)
    assert np.array_equal(ids, want_ids)
    np.testing.assert_allclose(gates, want_gates, rtol=2e-6, atol=1e-7)
    for row in range(s):  # each row alone
        one_ids, one_gates = native.route(h[row : row + 1], w, bias, rule, n)
        assert np.array_equal(one_ids[0], ids[row])
        assert np.array_equal(one_gates[0].view(np.uint32), gates[row].view(np.uint32))


def test_ties_go_to_the_lowest_index() -> None:
    h = np.ones((1, 8), dtype=np.float32)
    w = np.zeros((6, 8), dtype=np.float32)  # every score is sigmoid(0) = 0.5
    ids, gates = native.route(h, w, None, RouteRule(3), 4)
    assert ids.tolist() == [[0, 1, 2, 3]]
    np.testing.assert_allclose(gates, [[1 / 3] * 3], rtol=1e-6)


def test_softmax_gates_are_probabilities_of_the_whole_row() -> None:
    """Without norm the gates are the chosen experts' share of all E probabilities, the
    softmax taken before the top-k (as transformers' Qwen3-MoE / OLMoE routers do)."""
    h = np.ones((1, 4), dtype=np.float32)
    w = np.array([[1.0] * 4, [0.5] * 4, [0.0] * 4, [0.0] * 4], dtype=np.float32)  # 4, 2, 0, 0
    ids, gates = native.route(h, w, None, RouteRule(2, norm=False, softmax=True), 2)
    p = np.exp([4.0, 2.0, 0.0, 0.0])
    p /= p.sum()
    assert ids.tolist() == [[0, 1]]
    np.testing.assert_allclose(gates[0], p[:2], rtol=1e-6)
    _, normed = native.route(h, w, None, RouteRule(2, softmax=True), 2)
    np.testing.assert_allclose(normed[0], p[:2] / p[:2].sum(), rtol=1e-6)


@pytest.mark.parametrize(
    "rule,n,message",
    [
        (RouteRule(3, 4, 2), 2, "disagree"),
        (RouteRule(2, 4, 2), 20, "disagree"),
        (RouteRule(2, 3, 2), 4, "disagree"),
        (RouteRule(2, 4, 5), 4, "topk_group"),
    ],
)
def test_bad_arguments_are_refused(rule, n, message) -> None:
    h = np.zeros((1, 8), dtype=np.float32)
    with pytest.raises(ValueError, match=message):
        native.route(h, np.zeros((16, 8), dtype=np.float32), None, rule, n)
