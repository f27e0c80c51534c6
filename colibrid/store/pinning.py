"""AUTOPIN (learned pins at start-up) and REPIN (swaps at request boundaries).

Why upstream's numbers: they were tuned on real GLM-5 histories (DESIGN §5). AUTOPIN
needs >= 5,000 recorded selections, scales its share by confidence = min(1, n/200,000),
pins 0.5 x confidence x the expert RAM, and never takes room the no-pin plan would have
given the plain cache (so pins only use what the per-layer cache cannot). REPIN swaps
the hottest unpinned expert of a layer for its coldest pinned one only when the hot one
beats the cold one by 25% + 4 uses (hysteresis), at most 4 swaps a pass, with session
heat halved after each pass.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

AUTOPIN_MIN_SELECTIONS = 5_000
AUTOPIN_FULL_CONFIDENCE = 200_000
AUTOPIN_SHARE = 0.5
REPIN_MARGIN = 0.25
REPIN_SLACK = 4
REPIN_MAX_SWAPS = 4


def confidence(selections: int) -> float:
    return min(1.0, selections / AUTOPIN_FULL_CONFIDENCE)


def autopin_slots(
    selections: int, expert_room: int, slot_bytes: int, n_layers: int, n_experts: int
) -> int:
    """How many experts AUTOPIN pins out of ``expert_room`` bytes (0 below the minimum)."""
    if selections < AUTOPIN_MIN_SELECTIONS or slot_bytes <= 0:
        return 0
    want = int(expert_room * AUTOPIN_SHARE * confidence(selections)) // slot_bytes
    per_layer = min(n_experts, expert_room // max(1, n_layers * slot_bytes))
    leftover = (expert_room - per_layer * n_layers * slot_bytes) // slot_bytes
    if per_layer >= n_experts:  # the cache already holds everything
        return 0
    return max(0, min(want, leftover))


def hottest(counts: np.ndarray, layers: Iterable[int], n: int) -> list[tuple[int, int]]:
    """The ``n`` most selected (layer, expert) keys; ties to the lower layer, then expert."""
    keys = [
        (int(-counts[la, e]), la, e)
        for la in layers
        for e in range(counts.shape[1])
        if counts[la, e] > 0
    ]
    keys.sort()
    return [(la, e) for _, la, e in keys[:n]]


class Repinner:
    """Session heat per (layer, expert) and the swap rule; the store does the moves."""

    def __init__(self, n_layers: int, n_experts: int) -> None:
        self.heat = np.zeros((n_layers, n_experts), dtype=np.float64)

    def record(self, layer: int, experts: np.ndarray) -> None:
        np.add.at(self.heat[layer], experts, 1.0)

    def swaps(
        self, pinned: Iterable[tuple[int, int]]
    ) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """(cold pinned key, hot unpinned key) pairs to swap now; then heat halves."""
        by_layer: dict[int, list[int]] = {}
        for la, e in pinned:
            by_layer.setdefault(la, []).append(e)
        out = []
        for la, pins in sorted(by_layer.items()):
            if len(out) >= REPIN_MAX_SWAPS:
                break
            row = self.heat[la]
            cold = min(pins, key=lambda e: (row[e], e))
            mask = np.ones(row.shape[0], dtype=bool)
            mask[pins] = False
            if not mask.any():
                continue
            cand = np.flatnonzero(mask)
            hot = int(cand[np.argmax(row[cand])])
            if row[hot] > row[cold] * (1 + REPIN_MARGIN) + REPIN_SLACK:
                out.append(((la, cold), (la, hot)))
        self.heat *= 0.5
        return out
