"""The MoE router shared by GLM-4.x, GLM-5.x and DeepSeek-V3 (DESIGN.md section 3, step 1).

Sigmoid scores in float32; `scores + e_score_correction_bias` is used for selection only;
group-limited top-k (a group's score is the sum of its two best experts; only the best
`topk_group` groups compete); gates are the plain sigmoid of the chosen experts,
normalised to sum 1 when `norm_topk_prob`, then multiplied by `routed_scaling_factor`.
Ties go to the lowest expert index (a stable sort), so routing is deterministic.

Shape legend: S rows, D hidden, E experts, K experts per token, G groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Route:
    """The router's decision for S rows: expert ids [S, K] and their gates [S, K]."""

    experts: np.ndarray  # int64 [S, K]
    gates: np.ndarray  # float32 [S, K]


class Router:
    def __init__(
        self,
        weight: np.ndarray,
        bias: np.ndarray | None,
        *,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        scaling: float,
    ) -> None:
        self.weight = weight  # f32 [E, D]
        self.bias = bias  # f32 [E] or None
        self.top_k = top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.scaling = np.float32(scaling)

    @property
    def n_experts(self) -> int:
        return self.weight.shape[0]

    def scores(self, h: np.ndarray) -> np.ndarray:
        """Sigmoid router scores, float32 [S, E]."""
        logits = h.astype(np.float32, copy=False) @ self.weight.T  # [S, E]
        np.negative(logits, out=logits)
        np.exp(logits, out=logits)
        logits += np.float32(1.0)
        return np.divide(np.float32(1.0), logits, out=logits)  # in place: decode is ~1 us each

    def route(self, h: np.ndarray) -> Route:
        scores = self.scores(h)  # [S, E]
        experts = _top_indices(self._selection(scores), self.top_k)  # [S, K]
        gates = scores[np.arange(scores.shape[0])[:, None], experts]  # [S, K]
        if self.norm_topk_prob:
            gates /= gates.sum(axis=1, keepdims=True, dtype=np.float32) + np.float32(1e-20)
        gates *= self.scaling
        return Route(experts=experts, gates=gates)

    def candidates(self, h: np.ndarray, n: int) -> np.ndarray:
        """The ``n`` best experts per row by the selection score, best first [S, n]: the
        top-k that `route` picks, then the runners-up (PILOT's ranked guesses)."""
        choice = self._selection(self.scores(h))
        return _top_indices(np.where(np.isfinite(choice), choice, -np.inf), min(n, self.n_experts))

    def _selection(self, scores: np.ndarray) -> np.ndarray:
        """Scores as selection sees them: bias added, losing groups masked to -inf."""
        choice = scores + self.bias if self.bias is not None else scores.copy()
        if self.n_group > 1 and self.topk_group < self.n_group:
            choice = self._mask_groups(choice)
        return choice

    def _mask_groups(self, choice: np.ndarray) -> np.ndarray:
        rows = choice.shape[0]
        grouped = choice.reshape(rows, self.n_group, -1)  # [S, G, E/G]
        best_two = -np.sort(-grouped, axis=-1)[..., :2]
        group_scores = best_two.sum(axis=-1, dtype=np.float32)  # [S, G]
        keep = _top_indices(group_scores, self.topk_group)  # [S, topk_group]
        mask = np.zeros((rows, self.n_group), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=1)
        masked = np.where(mask[:, :, None], grouped, -np.inf).astype(np.float32)
        return masked.reshape(rows, -1)


def _top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values per row, largest first, ties to the lowest index."""
    order = np.argsort(-values, axis=1, kind="stable")
    return order[:, :k].astype(np.int64)
