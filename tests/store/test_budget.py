"""The RAM planner: a comfortable budget keeps the full overhead; a tight one sheds PILOT's
slots, then work slots down to two, then reserve down to its floor, and says so; only a
budget below the stated minimum is refused, with that minimum in the message."""

from __future__ import annotations

import pytest

from colibrid.errors import ModelLoadError
from colibrid.store import budget

MiB = 1 << 20
SLOT = 21 * MiB
DENSE = int(1.1 * budget.GiB)
KV = 90 * MiB


def _plan(total: int, **kw):
    args = dict(
        total=total,
        source="--ram-gb",
        dense=DENSE,
        kv=KV,
        slot_bytes=SLOT,
        n_layers=7,
        n_experts=64,
        work_slots=16,
        pilot_slots=12,
    )
    return budget.plan(**(args | kw))


def test_a_comfortable_budget_keeps_every_slot_and_the_full_reserve() -> None:
    p = _plan(int(3.5 * budget.GiB))
    assert (p.work_slots, p.pilot_slots, p.note) == (16, 12, "")
    assert p.reserve == budget.reserve_for(p.total)
    assert p.cache_per_layer > 0
    used = p.dense + p.kv + p.work + p.reserve + p.cache_bytes
    assert used <= p.total


def test_pilot_slots_go_first() -> None:
    full = DENSE + KV + 28 * SLOT + budget.reserve_for(2 * budget.GiB)
    p = _plan(full - 5 * SLOT)
    assert p.work_slots == 16 and p.pilot_slots < 12
    assert "PILOT slots 12 ->" in p.note and p.cache_per_layer == 0


def test_a_tight_budget_sheds_work_slots_then_reserve_and_still_fits() -> None:
    total = int(1.34 * budget.GiB)
    p = _plan(total)
    assert p.pilot_slots == 0 and p.work_slots == budget.MIN_WORK_SLOTS
    assert budget.reserve_floor(total) <= p.reserve < budget.reserve_for(total)
    assert "work slots 16 -> 2" in p.note and "reserve" in p.note
    assert p.dense + p.kv + p.work + p.reserve <= total


def test_the_minimum_is_exactly_the_least_budget_accepted() -> None:
    least = budget.minimum_budget(dense=DENSE, kv=KV, slot_bytes=SLOT)
    p = _plan(least)
    assert p.work_slots == budget.MIN_WORK_SLOTS and p.cache_per_layer == 0
    with pytest.raises(ModelLoadError, match=rf"minimum of {least / budget.GiB:.2f} GiB"):
        _plan(least - MiB)


def test_cache_flag_overrides_the_budget_without_shedding() -> None:
    p = _plan(int(1.34 * budget.GiB), cache=3)
    assert (p.cache_per_layer, p.work_slots, p.pilot_slots, p.source) == (3, 16, 12, "--cache")
