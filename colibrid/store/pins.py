"""The pin controller: one rule for which experts stay pinned, used at start-up, by
`colibrid generate --pin`, by the daemon and by `colibri profile use`.

Why one rule: pins used to be chosen twice (AUTOPIN at start, a fixed share of all
experts in the daemon) and the second never asked the store how many slots it had.
Here the *capacity* is fixed when the store is planned (slots reserved for pins, never
taken from the cache or the work slots) and every selection fits inside it:

- AUTOPIN (upstream, tuned on real GLM-5 histories, docs/formats.md): nothing below 5,000
  recorded selections; then 0.5 x confidence x the expert RAM, confidence =
  min(1, n/200,000), the hottest experts first (ties to the lower layer, then expert);
- ``all``: as many of the used experts as the capacity holds;
- REPIN: at request boundaries, swap a layer's coldest pin for its hottest unpinned
  expert when the hot one beats it by 25% + 4 uses of session heat (hysteresis), at
  most 4 swaps a pass, heat halved after each pass.

A selection that wants more than the capacity pins the hottest that fit and says so
(:attr:`PinController.note`, shown by ``colibri ps``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

AUTOPIN_MIN_SELECTIONS = 5_000
AUTOPIN_FULL_CONFIDENCE = 200_000
AUTOPIN_SHARE = 0.5
REPIN_MARGIN = 0.25
REPIN_SLACK = 4
REPIN_MAX_SWAPS = 4
PIN_MODES = ("off", "auto", "all")

Key = tuple[int, int]


def confidence(selections: int) -> float:
    return min(1.0, selections / AUTOPIN_FULL_CONFIDENCE)


def hottest(counts: np.ndarray, layers: Iterable[int], n: int) -> list[Key]:
    """The ``n`` most selected (layer, expert) keys with a non-zero count; ties to the
    lower layer, then the lower expert."""
    keys = [
        (int(-counts[la, e]), la, e)
        for la in layers
        for e in range(counts.shape[1])
        if counts[la, e] > 0
    ]
    keys.sort()
    return [(la, e) for _, la, e in keys[: max(n, 0)]]


@dataclass(frozen=True)
class PinBudget:
    """Planned at start: ``capacity`` slots reserved for pins; ``autopin_slots`` is what
    AUTOPIN would pin at full confidence (0.5 x the expert RAM, in slots)."""

    mode: str
    capacity: int
    autopin_slots: int

    @staticmethod
    def plan(
        mode: str, *, expert_room: int, cache_room: int, slot_bytes: int, n_experts_total: int
    ) -> PinBudget:
        """``expert_room``: bytes the budget leaves for experts (after dense, KV, reserve,
        work and PILOT slots); ``cache_room``: bytes of it the plain cache takes. Pins
        never take what the cache would have had."""
        if mode not in PIN_MODES:
            raise ValueError(f"--pin must be one of {PIN_MODES}, got {mode!r}")
        slot = max(1, slot_bytes)
        left = max(0, expert_room - cache_room) // slot
        share = int(max(0, expert_room) * AUTOPIN_SHARE) // slot
        if mode == "off":
            return PinBudget(mode, 0, 0)
        if mode == "all":
            return PinBudget(mode, min(n_experts_total, left), share)
        return PinBudget(mode, min(n_experts_total, left, share), share)


class PinnedTier(Protocol):
    """What the controller needs of a store: the pinned set and the two moves."""

    def pinned_keys(self) -> Sequence[Key]: ...

    def pin_room(self) -> int: ...

    def pin_one(self, key: Key) -> None: ...

    def unpin(self, key: Key) -> None: ...


class PinController:
    def __init__(self, budget: PinBudget) -> None:
        self.budget = budget
        self.wanted = 0
        self.note = "off" if budget.mode == "off" else f"none yet (capacity {budget.capacity})"

    def choose(self, counts: np.ndarray, layers: Sequence[int]) -> list[Key]:
        """The pins for these usage counts, hottest first, within the capacity."""
        b = self.budget
        served = counts[list(layers)]
        used, selections = int(np.count_nonzero(served)), int(served.sum())
        if b.mode == "off":
            self.wanted = 0
        elif b.mode == "all":
            self.wanted = used if selections else len(layers) * counts.shape[1]
        elif selections < AUTOPIN_MIN_SELECTIONS:
            self.wanted = 0
        else:
            self.wanted = min(used, int(b.autopin_slots * confidence(selections)))
        n = min(self.wanted, b.capacity)
        if b.mode == "all" and not selections:  # nothing learned yet: the first experts
            keys = [(la, e) for la in layers for e in range(counts.shape[1])][:n]
        else:
            keys = hottest(counts, layers, n)
        self.note = self._describe(len(keys), selections)
        return keys

    def _describe(self, n: int, selections: int) -> str:
        b = self.budget
        if b.mode == "off":
            return "off"
        if b.capacity == 0:
            return (
                "none: the RAM budget leaves no room for pins beyond the cache "
                "(raise --ram-gb or lower --cache)"
            )
        if b.mode == "auto" and selections < AUTOPIN_MIN_SELECTIONS:
            return (
                f"none: {selections} selections recorded, AUTOPIN needs "
                f"{AUTOPIN_MIN_SELECTIONS} (capacity {b.capacity})"
            )
        if self.wanted > b.capacity:
            return (
                f"{n} hottest of {self.wanted} wanted: the pin capacity is {b.capacity} "
                "(raise --ram-gb or lower --cache for more)"
            )
        return f"{n} of capacity {b.capacity}"

    def apply(self, tier: PinnedTier, keys: Sequence[Key]) -> int:
        """Make ``keys`` the pinned set: unpin what left it, then pin newcomers hottest
        first while the tier has room (it always has for a choice of :meth:`choose`)."""
        want = set(keys)
        for key in [k for k in tier.pinned_keys() if k not in want]:
            tier.unpin(key)
        held = set(tier.pinned_keys())
        for key in keys:
            if key not in held and tier.pin_room() > 0:
                tier.pin_one(key)
        return len(tier.pinned_keys())


def repin_swaps(heat: np.ndarray, pinned: Iterable[Key]) -> list[tuple[Key, Key]]:
    """(cold pinned key, hot unpinned key) pairs to swap now; then the heat halves."""
    by_layer: dict[int, list[int]] = {}
    for la, e in pinned:
        by_layer.setdefault(la, []).append(e)
    out = []
    for la, pins in sorted(by_layer.items()):
        if len(out) >= REPIN_MAX_SWAPS:
            break
        row = heat[la]
        cold = min(pins, key=lambda e: (row[e], e))
        mask = np.ones(row.shape[0], dtype=bool)
        mask[pins] = False
        if not mask.any():
            continue
        cand = np.flatnonzero(mask)
        hot = int(cand[np.argmax(row[cand])])
        if row[hot] > row[cold] * (1 + REPIN_MARGIN) + REPIN_SLACK:
            out.append(((la, cold), (la, hot)))
    heat *= 0.5
    return out
