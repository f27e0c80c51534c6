"""What a tiered store's memory is built from: one plan.

The store is constructed with a :class:`MemoryPlanner` holding every input the budget
needs but the store's own shape: the budget and dense bytes from the headers, the KV
size the config gives (``Engine.load``), the user's knobs (``options.TierPlanner``). Once
the constructor has planned the extents it asks for one :class:`StorePlan` and builds its
whole memory side from it. Nothing is set on the store from outside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from colibrid.store.budget import BudgetPlan
from colibrid.store.pilot_switch import PilotSwitch
from colibrid.store.pins import PinBudget
from colibrid.store.usage import UsageProfile


@dataclass(frozen=True)
class StorePlan:
    """Everything a tiered store's memory is built from, decided in one place."""

    budget: BudgetPlan  # every byte: dense, KV, work and PILOT, reserve, pins, cache
    pin_budget: PinBudget  # the pin capacity (``budget.pins`` in slots) and its rule
    usage: UsageProfile  # the .coli_usage being learned (``--profile`` merged in)
    save_usage_to: str | None  # where it is saved after each request (None: never)
    pin_at_start: bool  # pin from ``usage`` now (else the daemon's profile book pins later)
    pilot_switch: PilotSwitch | None  # measures PILOT on vs off (None: nothing to measure)
    memwatch: bool  # MEMWATCH follows free memory and resizes the cache
    memory_floor: int | None  # bytes MEMWATCH keeps available (None: its default)

    @property
    def repin(self) -> bool:
        """REPIN swaps pins at request boundaries (session heat kept) when pins are planned."""
        return self.pin_budget.capacity > 0


class MemoryPlanner(Protocol):
    """The budget and knobs a tiered store was opened with."""

    def plan(
        self,
        *,
        layers: tuple[int, ...],
        n_layers: int,
        n_experts: int,
        slot_bytes: int,
    ) -> StorePlan:
        """The plan for a store of this shape. ``layers``: those usage and pins cover;
        ``n_layers``: those served (with drafting layers)."""
        ...
