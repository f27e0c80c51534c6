"""The MoE block: route, fetch each chosen expert once, apply it to every row that chose it.

Shape legend: S rows, D hidden, K experts per token.

The model never learns where an expert lives: it asks the expert source for the union of
the experts the rows chose. Each expert's contribution lands in a per-(row, slot) buffer
and the contributions are summed per row in ascending expert order, so the result does
not depend on the order in which experts arrive (cache hits first, disk reads later) —
placement never changes a token. The shared expert runs while the routed misses are being
read (the store dispatches them when asked) and is added last, as it always was. A group of
experts is one backend call; a layer whose experts all stay in memory (the resident
store) is a single ``Ops.moe`` call, router and combine included, which computes exactly
what the three steps compute (``moe_each``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from colibrid.backends.base import KernelFamily
from colibrid.backends.moe_plan import combine
from colibrid.models.base import ExpertSource, Ops
from colibrid.models.layers.mlp import MLP
from colibrid.models.layers.router import Router


class MoE:
    def __init__(
        self, layer: int, router: Router, experts: ExpertSource, ops: Ops, shared: MLP | None
    ) -> None:
        self.layer = layer
        self.router = router
        self.experts = experts
        self.ops = ops
        self.shared = shared
        # Ops.moe computes this class's combine with the router's plain logits; a router
        # with a logit bias, or a subclass combining otherwise, clears it.
        self.fused = not router.logit_bias

    def __call__(self, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        resident = self.experts.resident(self.layer) if self.fused else None
        if resident is not None:
            r = self.router
            ids, out = self.ops.moe(x, r.weight, r.bias, r.rule, resident, self.shared, family)
            self.experts.record(self.layer, sorted(set(ids.ravel().tolist())))
            return out
        route = self.router.route(x)
        ids = route.experts.tolist()  # [S][K] as Python ints, planned over below
        groups = self.fetch(ids)  # misses start streaming now
        return self.combine(x, ids, route.gates.tolist(), groups, family)

    def fetch(self, ids: list[list[int]]) -> Iterable[list[tuple[int, Any]]]:
        """Record the routing and ask the store for the union of chosen experts."""
        union = sorted({e for row in ids for e in row})  # ascending expert ids
        self.experts.record(self.layer, union)
        return self.experts.iter_groups(self.layer, union)  # resident first, misses as they land

    def combine(
        self,
        x: np.ndarray,
        ids: list[list[int]],
        gates: list[list[float]],
        groups: Iterable[list[tuple[int, Any]]],
        family: KernelFamily,
    ) -> np.ndarray:
        """Apply each group of experts as it arrives; sum per row in ascending expert order.

        Each (row, slot) writes its gated output at the expert's rank within its row, and
        the shared expert (gate 1) writes after the last rank, so summing the ranks in
        turn adds in ascending expert order, then the shared expert, whatever the arrival
        order. The shared expert rides with the first group (the experts in memory), so
        it is computed while the misses are read. Where each expert's rows go is planned
        with plain Python over the S x K ids: for a decode step (S = 1, K = 4..8) that is
        a few microseconds, where numpy's argsort and scatter cost more than the experts'
        arithmetic on small models.
        """
        return combine(self.ops, x, ids, gates, groups, self.shared, family)
