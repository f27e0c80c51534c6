"""The one pin rule (AUTOPIN, --pin all, REPIN's hysteresis), the slot plan it lives in,
and the pin controller driving the real tiered store (no fake store)."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.engine.engine import Engine
from colibrid.engine.generate import TokenEvent, generate
from colibrid.engine.sampling import SamplingParams
from colibrid.store.options import StoreOptions
from colibrid.store.pins import (
    AUTOPIN_FULL_CONFIDENCE,
    PinBudget,
    PinController,
    confidence,
    hottest,
    repin_swaps,
)
from colibrid.store.slots import Placement, SlotPlan, StoreError


def greedy(engine: Engine, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=20, temperature=0.0)
    return [e.token_id for e in generate(engine, prompt, params) if isinstance(e, TokenEvent)]


def test_hottest_ties_go_to_the_lowest_key_and_zeros_are_never_pinned() -> None:
    counts = np.zeros((3, 4), dtype=np.int64)
    counts[1, 2], counts[2, 0], counts[1, 3] = 9, 9, 1
    assert hottest(counts, (1, 2), 2) == [(1, 2), (2, 0)]
    assert hottest(counts, (1, 2), 10) == [(1, 2), (2, 0), (1, 3)]


def test_budget_never_takes_the_cache_share() -> None:
    slot = 10**6
    # 13 slots of room, the cache takes 12 (6 x 2 layers): AUTOPIN gets the 1 left over
    b = PinBudget.plan(
        "auto", expert_room=13 * slot, cache_room=12 * slot, slot_bytes=slot, n_experts_total=32
    )
    assert (b.capacity, b.autopin_slots) == (1, 6)
    # --cache given with room to spare: AUTOPIN's share (half the room), never more
    b = PinBudget.plan(
        "auto", expert_room=40 * slot, cache_room=4 * slot, slot_bytes=slot, n_experts_total=32
    )
    assert b.capacity == 20
    b = PinBudget.plan(
        "all", expert_room=40 * slot, cache_room=4 * slot, slot_bytes=slot, n_experts_total=32
    )
    assert b.capacity == 32  # capped at the number of experts
    assert PinBudget.plan(
        "off", expert_room=40 * slot, cache_room=0, slot_bytes=slot, n_experts_total=32
    ) == PinBudget("off", 0, 0)


def test_autopin_scales_with_confidence_and_says_why() -> None:
    ctl = PinController(PinBudget("auto", capacity=6, autopin_slots=20))
    counts = np.zeros((2, 8), dtype=np.int64)
    counts[1, :] = 600  # 4,800 selections: below AUTOPIN's minimum
    assert ctl.choose(counts, (1,)) == [] and "5000" in ctl.note
    counts[1, :] = 12_500  # 100,000 selections: confidence 0.5 -> 10 wanted, 6 fit
    assert confidence(100_000) == 0.5 and confidence(10 * AUTOPIN_FULL_CONFIDENCE) == 1.0
    keys = ctl.choose(counts, (1,))
    assert len(keys) == 6 and ctl.wanted == 8  # only 8 experts are used at all
    assert "6 hottest of 8 wanted" in ctl.note and "capacity is 6" in ctl.note


def test_repin_hysteresis_and_heat_halving() -> None:
    heat = np.zeros((2, 4))
    np.add.at(heat[1], np.array([0] * 10 + [1] * 17), 1.0)  # 17 > 10 * 1.25 + 4
    assert repin_swaps(heat, [(1, 0)]) == [((1, 0), (1, 1))]
    assert heat[1, 1] == 8.5  # session heat halves after each pass
    heat = np.zeros((2, 4))
    np.add.at(heat[1], np.array([0] * 10 + [1] * 13), 1.0)  # 13 <= 16.5: no swap
    assert repin_swaps(heat, [(1, 0)]) == []


def test_placement_bounds_pins_and_keeps_the_work_slots() -> None:
    plan = SlotPlan(pins=2, cache_per_layer=1, n_layers=2, work=3, pilot=1)
    pl = Placement(plan, (0, 1), "lfru")
    assert plan.total == 8 and len(pl.parked) == 2  # unused pin room holds no pages
    for key in [(0, 0), (0, 1)]:
        pl.pin_on_land.add(key)
        pl.rebalance()
        pl.settle_pin(key, pl.take())
    assert pl.pin_room() == 0 and not pl.parked
    with pytest.raises(StoreError, match="pin budget"):
        pl.settle_pin((1, 1), pl.take())
    pl.check(idle=False)


def test_controller_switches_pins_on_the_real_store_within_its_capacity(oracle_checkpoint) -> None:
    ref = oracle_checkpoint("deepseek_v3")
    opts = StoreOptions(mode="tiered", cache=2, pin="all", pilot="off", ram_gb=4)
    engine = Engine.load(ref.out_dir, store=opts)
    try:
        store = engine.experts
        capacity = store.plan.pins
        assert 0 < capacity and len(store.pinned) <= capacity
        layers = store.layers
        a = np.zeros(store.counts.shape, dtype=np.int64)
        b = np.zeros_like(a)
        a[layers[0], :] = np.arange(store.layout.n_experts) + 1
        b[layers[-1], 0] = 5
        assert store.apply_pins(a) == min(capacity, store.layout.n_experts)
        store.check_consistency()
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
        assert store.apply_pins(b) == 1 and store.pinned_keys() == [(layers[-1], 0)]
        store.check_consistency()
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
        assert store.statistics().pin_capacity == capacity
    finally:
        engine.close()


def test_a_profile_wanting_more_than_the_capacity_pins_the_hottest_that_fit(
    oracle_checkpoint,
) -> None:
    ref = oracle_checkpoint("deepseek_v3")
    engine = Engine.load(ref.out_dir, store=StoreOptions(mode="tiered", cache=2, pilot="off"))
    try:
        store = engine.experts
        store.allocate(2, work_slots=4, pin_budget=PinBudget("all", 3, 3))
        counts = np.zeros(store.counts.shape, dtype=np.int64)
        for i, layer in enumerate(store.layers):
            counts[layer, :] = np.arange(store.layout.n_experts) + 10 * i
        assert store.apply_pins(counts) == 3
        assert "3 hottest of" in store.pins.note
        top = hottest(counts, store.layers, 3)
        assert sorted(store.pinned_keys()) == sorted(top)
        store.check_consistency()
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()
