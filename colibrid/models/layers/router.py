"""The MoE router shared by every family (docs/architecture.md, step 1).

Scores in float32: a sigmoid per expert (GLM-4.x, GLM-5.x, DeepSeek-V3) or the softmax over
all experts (Qwen3-MoE, Mixtral, OLMoE; taken before the top-k, as transformers does, so
the gates are probabilities of the whole row); `scores + e_score_correction_bias` is used
for selection only; group-limited top-k (a group's score is the sum of its two best
experts; only the best `topk_group` groups compete); gates are the plain scores of the
chosen experts, normalised to sum 1 when `norm_topk_prob`, then multiplied by
`routed_scaling_factor`. Ties go to the lowest expert index (a stable sort), so routing is
deterministic. The backend computes it (`Ops.route`); `route_reference` is the rule in
numpy.

A router with a bias on its logits (gpt-oss: `router.bias`, which moves the gates as well
as the choice) is the same rule on one more input feature: each row gets a constant 1 and
the weight the bias as its last column, so every backend's route computes it unchanged.

Shape legend: S rows, D hidden, E experts, K experts per token, G groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from colibrid.backends.base import RouteRule

if TYPE_CHECKING:
    from colibrid.models.base import Ops


@dataclass(frozen=True)
class Route:
    """The router's decision for S rows: expert ids [S, K] and their gates [S, K]."""

    experts: np.ndarray  # int64 [S, K]
    gates: np.ndarray  # float32 [S, K]


class Router:
    """The routing rule and its weights; the arithmetic is the backend's (`Ops.route`)."""

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
        softmax: bool = False,
        logit_bias: np.ndarray | None = None,
        ops: Ops,
    ) -> None:
        self.logit_bias = logit_bias is not None
        if logit_bias is not None:  # [E, D + 1]: the bias as the weight of a constant 1
            weight = np.concatenate([weight, logit_bias.reshape(-1, 1)], axis=1)
        self.weight = weight  # f32 [E, D], or [E, D + 1] with a logit bias
        self.bias = bias  # f32 [E] or None: selection only
        self.rule = RouteRule(
            top_k, n_group, topk_group, norm_topk_prob, float(scaling), softmax=softmax
        )
        self.ops = ops

    @property
    def top_k(self) -> int:
        return self.rule.top_k

    @property
    def n_experts(self) -> int:
        return self.weight.shape[0]

    def route(self, h: np.ndarray) -> Route:
        experts, gates = self.ops.route(
            self._input(h), self.weight, self.bias, self.rule, self.top_k
        )
        return Route(experts=experts, gates=gates)

    def _input(self, h: np.ndarray) -> np.ndarray:
        """h [S, D], with a constant 1 appended to each row when the logits have a bias."""
        if not self.logit_bias:
            return h
        return np.concatenate([h, np.ones((h.shape[0], 1), dtype=np.float32)], axis=1)

    def candidates(self, h: np.ndarray, n: int) -> np.ndarray:
        """The ``n`` best experts per row by the selection score, best first [S, n]: the
        top-k that `route` picks, then the runners-up (PILOT's ranked guesses)."""
        n = max(self.top_k, min(n, self.n_experts))
        return self.ops.route(self._input(h), self.weight, self.bias, self.rule, n)[0]


def route_reference(
    h: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, rule: RouteRule, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """The routing rule in numpy (the reference `Ops.route` implementations must match up
    to float rounding): ids int64 [S, n] best first, gates float32 [S, top_k]."""
    n_group, topk_group = rule.n_group, rule.topk_group
    logits = h.astype(np.float32, copy=False) @ weight.T  # [S, E]
    if rule.softmax:
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True)).astype(np.float32)
        scores = shifted / shifted.sum(axis=1, keepdims=True, dtype=np.float32)
    else:
        scores = (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    choice = scores + bias if bias is not None else scores.copy()
    if n_group > 1 and topk_group < n_group:
        rows = choice.shape[0]
        grouped = choice.reshape(rows, n_group, -1)  # [S, G, E/G]
        best_two = -np.sort(-grouped, axis=-1)[..., :2]
        group_scores = best_two.sum(axis=-1, dtype=np.float32)  # [S, G]
        keep = _top_indices(group_scores, topk_group)  # [S, topk_group]
        mask = np.zeros((rows, n_group), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=1)
        choice = np.where(mask[:, :, None], grouped, -np.inf).astype(np.float32).reshape(rows, -1)
    experts = _top_indices(choice, n)  # [S, n]
    gates = np.take_along_axis(scores, experts[:, : rule.top_k], axis=1)  # [S, K]
    if rule.norm:
        gates = gates / (gates.sum(axis=1, keepdims=True, dtype=np.float32) + np.float32(1e-20))
    return experts, (gates * np.float32(rule.scaling)).astype(np.float32)


def _top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values per row, largest first, ties to the lowest index."""
    order = np.argsort(-values, axis=1, kind="stable")
    return order[:, :k].astype(np.int64)
