"""How a MoE layer's routed rows become expert calls: which rows each chosen expert takes,
where each result lands (the expert's rank in its row, the shared expert last) and the
rank-ordered sum, so the layer's result never depends on the order experts arrive in.

It sits with the backends, not the models, because a backend's fused `Ops.moe` must
compute exactly this (`moe_each` is its definition, and what the backends without a fused
form run); the models' MoE block calls `combine` for the layers whose experts stream.

Where each expert's rows go is planned with plain Python over the S x K ids: for a decode
step (S = 1, K = 4..8) that is a few microseconds, where numpy's argsort and scatter cost
more than the experts' arithmetic on small models.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from colibrid.backends.base import (
    ExpertBatch,
    KernelFamily,
    ResidentExperts,
    RouteRule,
    SwiGLUWeights,
)


def combine(
    ops: Any,
    x: np.ndarray,
    ids: list[list[int]],
    gates: list[list[float]],
    groups: Iterable[list[tuple[int, Any]]],
    shared: SwiGLUWeights | None,
    family: KernelFamily,
) -> np.ndarray:
    """A MoE layer's experts through ``ops`` (models.base.Ops), group by group as the
    store delivers them: each group one `apply_experts` call (the shared expert rides
    with the first), then one `rank_sum` over the ranks."""
    rows, top_k = len(ids), len(ids[0])
    plan = plan_rows(ids)
    width = top_k + (shared is not None)  # ranks per row, the shared expert last
    parts = np.empty((rows * width, x.shape[1]), dtype=np.float32)  # [S * rank, D]
    for group in groups:
        batch = expert_batch(group, plan, gates, width, shared, rows)
        shared = None
        ops.apply_experts(batch, x, parts, family)
    if shared is not None:  # the store delivered no group at all
        ops.apply_experts(expert_batch([], plan, gates, width, shared, rows), x, parts, family)
    return ops.rank_sum(parts.reshape(rows, width, x.shape[1]))


def moe_each(
    ops: Any,
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None,
    rule: RouteRule,
    layer: ResidentExperts,
    shared: SwiGLUWeights | None,
    family: KernelFamily,
) -> tuple[np.ndarray, np.ndarray]:
    """`Ops.moe` from the other ops, as the MoE block runs a layer whose experts arrive
    all at once: the definition every backend's fused form must match bit for bit."""
    experts, gates = ops.route(x, weight, bias, rule, rule.top_k)
    ids = experts.tolist()
    union = sorted({e for row in ids for e in row})
    group = [(e, layer.experts[e]) for e in union]
    return experts, combine(ops, x, ids, gates.tolist(), [group], shared, family)


def expert_batch(
    group: list[tuple[int, Any]],
    plan: dict[int, tuple[list[int], list[int], list[int]]],
    gates: list[list[float]],
    width: int,
    shared: SwiGLUWeights | None,
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
