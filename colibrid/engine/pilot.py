"""PILOT: predict the next MoE layer's experts from this layer's post-attention state.

Layer L+1's post-attention norm and router are applied to layer L's post-attention
residual (stale by one MoE residual: upstream measured 71.6% recall on GLM-5.2); the
store then reads the predicted misses in the background (``store.hint``), never blocking
layer L and never evicting what L needs. The prediction only moves bytes, so tokens
cannot change; the store reports recall and how many misses became hits.
"""

from __future__ import annotations

import numpy as np

from colibrid.models.base import Lookahead, Model, NextMoE
from colibrid.store.protocol import ExpertStore

# Runners-up hinted after the top-k, as a share of k (measured with `colibri bench stream`
# on a GLM-5-shaped model: recall 74% -> 90%, 0.5 GB/token fewer demand misses; the
# extra guesses queue behind the sure ones and are withdrawn unread when wrong). Checked
# again with two experts' bytes of background reads in flight (io_pool.IOPool), which read
# more of them: on the synthetic GLM-5 at 3x the budget, five runs each in ABBA order,
# 0.5 vs none gave 1.600 vs 1.592 tok/s for 0.989 vs 0.981 GB read a token, a tie; on the
# demo at `--cache 2` they keep the hit rate at 88-90% instead of 75-78%.
EXTRA_GUESSES = 0.5


def attach(model: Model, store: ExpertStore) -> int:
    """Give every decoder layer followed by a MoE layer a lookahead; returns how many."""
    return model.set_lookahead(lambda nxt: _predictor(nxt, store))


def most_confident_first(experts: np.ndarray) -> list[int]:
    """The distinct experts of a route [S, K] (each row best first): every row's first
    choice, then every row's second, ... so reads start with the surest guesses."""
    ranked = experts.T.reshape(-1)
    _, first = np.unique(ranked, return_index=True)
    return ranked[np.sort(first)].tolist()


def _predictor(nxt: NextMoE, store: ExpertStore) -> Lookahead:
    n_guess = nxt.top_k + int(nxt.top_k * EXTRA_GUESSES)
    layer = nxt.moe_layer

    def lookahead(h: np.ndarray) -> None:
        store.hint(layer, most_confident_first(nxt.candidates(h, n_guess)))

    return lookahead
