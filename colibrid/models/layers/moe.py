"""The MoE block: route, fetch each chosen expert once, apply it to every row that chose it.

Shape legend: S rows, D hidden, K experts per token.

The model never learns where an expert lives: it asks the expert source for the union of
the experts the rows chose. Each expert's contribution lands in a per-(row, slot) buffer
and the contributions are summed per row in ascending expert order, so the result does
not depend on the order in which experts arrive (cache hits first, disk reads later) —
placement never changes a token. The shared expert runs while the routed misses are being
read (the store dispatches them when asked) and is added last, as it always was.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from colibrid.backends.base import KernelFamily
from colibrid.models.base import ExpertSource, Ops
from colibrid.models.layers.mlp import MLP
from colibrid.models.layers.router import Route, Router


class MoE:
    def __init__(
        self, layer: int, router: Router, experts: ExpertSource, ops: Ops, shared: MLP | None
    ) -> None:
        self.layer = layer
        self.router = router
        self.experts = experts
        self.ops = ops
        self.shared = shared

    def __call__(self, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        route = self.router.route(x)
        pairs = self.fetch(route)  # misses start streaming now
        shared = self.shared(x, family) if self.shared is not None else None
        out = self.combine(x, route, pairs, family)
        if shared is not None:
            out += shared
        return out

    def fetch(self, route: Route) -> Iterable[tuple[int, Any]]:
        """Record the routing and ask the store for the union of chosen experts."""
        union = sorted(set(route.experts.ravel().tolist()))  # ascending expert ids
        self.experts.record(self.layer, union)
        return self.experts.iter_ready(self.layer, union)  # resident first, misses as they land

    def combine(
        self, x: np.ndarray, route: Route, pairs: Iterable[tuple[int, Any]], family: KernelFamily
    ) -> np.ndarray:
        """Apply each expert as it arrives; sum per row in ascending expert order.

        Each (row, slot) writes its gated output at the expert's rank within its row, so
        summing the ranks in turn adds in ascending expert order whatever the arrival
        order. Where each expert's rows go is planned with plain Python over the S x K
        ids: for a decode step (S = 1, K = 4..8) that is a few microseconds, where the
        numpy equivalent (argsort, put_along_axis, a nonzero per expert) cost more than
        the experts' arithmetic on small models.
        """
        rows, top_k = route.experts.shape
        plan = _plan(route.experts.tolist())
        gates = route.gates
        ordered = np.zeros((rows, top_k, x.shape[1]), dtype=np.float32)  # [S, rank, D]
        for expert, w in pairs:
            row_idx, slot_idx, rank_idx = plan[expert]
            if len(row_idx) == 1:  # decode, and rarely chosen experts: plain indexing
                row, slot, rank = row_idx[0], slot_idx[0], rank_idx[0]
                xs = np.ascontiguousarray(x[row : row + 1])
                y = self.ops.expert_swiglu(w.gate, w.up, w.down, xs, family)
                y *= gates[row, slot]
                ordered[row, rank] = y[0]
                continue
            xs = x if len(row_idx) == rows else x[row_idx]  # a row chooses an expert once
            y = self.ops.expert_swiglu(w.gate, w.up, w.down, np.ascontiguousarray(xs), family)
            y *= gates[row_idx, slot_idx][:, None]
            ordered[row_idx, rank_idx] = y
        out = np.zeros((rows, x.shape[1]), dtype=np.float32)
        for k in range(top_k):
            out += ordered[:, k]
        return out


def _plan(ids: list[list[int]]) -> dict[int, tuple[list[int], list[int], list[int]]]:
    """For each chosen expert: the rows that chose it, the slot it has in each of them
    and its rank (position in ascending expert order) within each row."""
    plan: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for row, chosen in enumerate(ids):
        rank_of = {e: r for r, e in enumerate(sorted(chosen))}
        for slot, expert in enumerate(chosen):
            entry = plan.get(expert)
            if entry is None:
                entry = plan[expert] = ([], [], [])
            entry[0].append(row)
            entry[1].append(slot)
            entry[2].append(rank_of[expert])
    return plan
