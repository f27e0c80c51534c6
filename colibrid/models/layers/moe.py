"""The MoE block: route, fetch each chosen expert once, apply it to every row that chose it.

Shape legend: S rows, D hidden, K experts per token.

The model never learns where an expert lives: it asks the expert source for the union of
the experts the rows chose. Each expert's contribution lands in a per-(row, slot) buffer
and the contributions are summed per row in ascending expert order, so the result does
not depend on the order in which experts arrive (cache hits first, disk reads later) —
placement never changes a token. The shared expert runs while the routed misses are being
read (the store dispatches them when asked) and is added last, as it always was. A group of
experts is one backend call, so a resident layer costs one call however many experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from colibrid.backends.base import ExpertBatch, KernelFamily
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

    def __call__(self, x: np.ndarray, family: KernelFamily) -> np.ndarray:
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
        rows, top_k = len(ids), len(ids[0])
        plan = plan_rows(ids)
        width = top_k + (self.shared is not None)  # ranks per row, the shared expert last
        parts = np.empty((rows * width, x.shape[1]), dtype=np.float32)  # [S * rank, D]
        shared = self.shared
        for group in groups:
            batch = _batch(group, plan, gates, width, shared, rows)
            shared = None
            self.ops.apply_experts(batch, x, parts, family)
        if shared is not None:  # the store delivered no group at all
            self.ops.apply_experts(_batch([], plan, gates, width, shared, rows), x, parts, family)
        return self.ops.rank_sum(parts.reshape(rows, width, x.shape[1]))


def _batch(
    group: list[tuple[int, Any]],
    plan: dict[int, tuple[list[int], list[int], list[int]]],
    gates: list[list[float]],
    width: int,
    shared: MLP | None,
    rows: int,
) -> ExpertBatch:
    """The pairs of a group's experts (and of the shared expert, when given)."""
    weights: list[Any] = []
    start = [0]
    row_of: list[int] = []
    gate_of: list[float] = []
    dest: list[int] = []
    for expert, w in group:
        row_idx, slot_idx, rank_idx = plan[expert]
        weights.append(w)
        for row, slot, rank in zip(row_idx, slot_idx, rank_idx, strict=True):
            row_of.append(row)
            gate_of.append(gates[row][slot])
            dest.append(row * width + rank)
        start.append(len(row_of))
    if shared is not None:
        weights.append(shared)
        row_of.extend(range(rows))
        gate_of.extend([1.0] * rows)
        dest.extend(row * width + width - 1 for row in range(rows))
        start.append(len(row_of))
    return ExpertBatch(weights, start, row_of, gate_of, dest)


def plan_rows(ids: list[list[int]]) -> dict[int, tuple[list[int], list[int], list[int]]]:
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
