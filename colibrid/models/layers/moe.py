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
        union = np.unique(route.experts).tolist()  # ascending expert ids
        self.experts.record(self.layer, union)
        return self.experts.iter_ready(self.layer, union)  # resident first, misses as they land

    def combine(
        self, x: np.ndarray, route: Route, pairs: Iterable[tuple[int, Any]], family: KernelFamily
    ) -> np.ndarray:
        """Apply each expert as it arrives; sum per row in ascending expert order."""
        rows, top_k = route.experts.shape
        # Each (row, slot) writes straight to its expert's rank within the row, so summing
        # the ranks in turn adds in ascending expert order with no reordering copy.
        order = np.argsort(route.experts, axis=1, kind="stable")  # ascending expert per row
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(top_k)[None, :], axis=1)
        ordered = np.zeros((rows, top_k, x.shape[1]), dtype=np.float32)  # [S, rank, D]
        for expert, w in pairs:
            row_idx, slot_idx = np.nonzero(route.experts == expert)
            y = self.ops.expert_swiglu(
                w.gate, w.up, w.down, np.ascontiguousarray(x[row_idx]), family
            )  # [n, D]
            y *= route.gates[row_idx, slot_idx][:, None]
            ordered[row_idx, rank[row_idx, slot_idx]] = y
        out = np.zeros((rows, x.shape[1]), dtype=np.float32)
        for k in range(top_k):
            out += ordered[:, k]
        return out
