"""PILOT's ranked guesses: the router's candidates start with exactly the experts it
routes to (group limits and bias included), and the hinted order puts every row's surest
choice first."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.backends.cpu import CpuOps
from colibrid.engine.pilot import most_confident_first
from colibrid.models.layers.router import Router


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_candidates_extend_the_route(n_group, topk_group) -> None:
    rng = np.random.default_rng(0)
    router = Router(
        rng.standard_normal((32, 16)).astype(np.float32),
        rng.standard_normal(32).astype(np.float32) * 0.1,
        top_k=4,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=True,
        scaling=1.0,
        ops=CpuOps(),
    )
    h = rng.standard_normal((5, 16)).astype(np.float32)
    cand = router.candidates(h, 6)
    assert cand.shape == (5, 6)
    assert np.array_equal(cand[:, :4], router.route(h).experts)
    assert all(len(set(row)) == 6 for row in cand.tolist())


def test_most_confident_first() -> None:
    ranked = np.array([[5, 1, 9], [1, 7, 5]])
    assert most_confident_first(ranked) == [5, 1, 7, 9]
