"""A layer cache of mixed-size experts (a precision plan) holds them by their bytes.

Why here: the invariance suites compare tokens, which a cache that sized every expert as
the largest still gets right (it only reads more). These drive :meth:`Placement.admit`
the way the layer server does for a miss, over a slot plan whose experts keep 1, 2 or 4
bytes of a 4-byte slot, and check the rules that make the smaller experts pay: more of
them fit, a large one displaces as many small ones as its bytes need (all or none), and
the bytes kept faulted never exceed what the uniform plan of the same budget faults.
"""

from __future__ import annotations

import random

import pytest

from colibrid.store.slot_sizes import SlotSizes
from colibrid.store.slots import DEMAND, Placement, SlotPlan

LAYER = 0
UNIT = 4
# expert 0-3 large (a whole slot), 4-11 half a slot, 12-15 a quarter
KEPT = (4,) * 4 + (2,) * 8 + (1,) * 4
SIZES = SlotSizes(UNIT, {LAYER: KEPT})


def placement(policy: str = "gated-lfru", cache: int = 2, work: int = 2) -> tuple:
    trimmed: list[tuple[int, int]] = []
    plan = SlotPlan(
        pins=0,
        cache_per_layer=cache,
        n_layers=1,
        work=work,
        pilot=0,
        cache_slots=SIZES.most_per_layer(cache, len(KEPT)),
    )
    pl = Placement(
        plan, (LAYER,), policy, trim=lambda slot, keep: trimmed.append((slot, keep)), sizes=SIZES
    )
    return pl, trimmed


def demand_read(pl: Placement, expert: int, uses: int = 1) -> bool:
    """What serving a miss does: the lookups counted, the read lands in a work slot, the
    layer offers it to the cache; whether it stayed."""
    for _ in range(uses):
        pl.policies[LAYER].seen(expert)
    slot = pl.take()
    pl.fill(slot, (LAYER, expert), DEMAND)
    return pl.admit(LAYER, expert, slot, protected=(), gate=True)


def budget_bytes(pl: Placement) -> int:
    """What the uniform plan of this budget keeps faulted: whole slots for the cache's
    ``cache_per_layer``, the work slots and PILOT."""
    return min(pl.n_slots, pl.wanted_faulted()) * UNIT


def test_the_sizes_come_from_slab_bytes_rounded_to_pages() -> None:
    sizes = SlotSizes.of_slabs({3: [8192, 4097, 100]}, 4096)
    assert sizes.unit == 8192 and sizes.of((3, 1)) == 8192 and sizes.of((3, 2)) == 4096
    assert sizes.mixed and sizes.most_per_layer(1, 3) == 2
    uniform = SlotSizes.of_slabs({0: [4096, 4000]}, 4096)
    assert not uniform.mixed and uniform.most_per_layer(2, 16) == 2


def test_a_cache_of_two_slots_holds_four_half_size_experts() -> None:
    pl, trimmed = placement()
    for e in (4, 5, 6, 7):
        assert demand_read(pl, e)
    assert set(pl.cache[LAYER]) == {4, 5, 6, 7}  # 4 x 2 bytes = the 2 slots' 8 bytes
    assert pl.cache_used[LAYER] == 2 * UNIT
    # each slot gave back the half its expert does not use
    assert sorted(keep for _, keep in trimmed) == [2, 2, 2, 2]
    assert pl.faulted <= budget_bytes(pl)
    pl.check(idle=True)


def test_a_large_read_displaces_as_many_small_ones_as_its_bytes_need() -> None:
    pl, _ = placement()
    for e in (4, 5, 6, 7):
        assert demand_read(pl, e, uses=1)
    assert demand_read(pl, 0, uses=3)  # hotter than every resident: needs two of them out
    assert 0 in pl.cache[LAYER] and len(pl.cache[LAYER]) == 3
    assert pl.cache_used[LAYER] == 2 * UNIT
    pl.check(idle=True)


@pytest.mark.parametrize("policy", ["gated-lfru", "heat-gated-lfru"])
def test_a_gate_that_refuses_any_victim_evicts_none(policy: str) -> None:
    pl, _ = placement(policy)
    assert demand_read(pl, 4, uses=1)
    for e in (5, 6, 7):
        assert demand_read(pl, e, uses=5)
    before = dict(pl.cache[LAYER])
    # hotter than expert 4 (the coldest) but not than the next: it would need both out
    assert not demand_read(pl, 0, uses=3)
    assert pl.cache[LAYER] == before  # nothing was evicted for a read that did not stay
    pl.check(idle=True)


def test_an_ungated_policy_always_makes_room() -> None:
    pl, _ = placement("lru")
    for e in (12, 13, 14, 15, 4, 5):
        assert demand_read(pl, e)
    assert len(pl.cache[LAYER]) == 6  # 4 x 1 + 2 x 2 bytes
    assert demand_read(pl, 1)  # the least recent out until 4 bytes are free
    assert 1 in pl.cache[LAYER] and pl.cache_used[LAYER] <= 2 * UNIT
    pl.check(idle=True)


@pytest.mark.parametrize("policy", ["lru", "lfru", "gated-lfru", "heat-gated-lfru"])
def test_any_sequence_of_reads_and_resizes_stays_within_the_budget(policy: str) -> None:
    """Seeded random traffic: the bookkeeping stays whole, the cache within its bytes
    and the faulted bytes within the uniform plan's, whatever arrives."""
    rng = random.Random(7)
    pl, _ = placement(policy, cache=3, work=3)
    most = 0
    for step in range(400):
        expert = rng.randrange(len(KEPT))
        if expert in pl.cache[LAYER]:
            pl.policies[LAYER].touch(expert)  # a hit: nothing is read
        else:
            demand_read(pl, expert, uses=rng.randint(1, 3))
        if step % 50 == 49:  # MEMWATCH's moves: shrink, then grow back
            pl.resize_cache(rng.randint(0, 3))
        pl.check(idle=True)
        assert pl.cache_used[LAYER] <= pl.cache_capacity
        assert pl.faulted <= budget_bytes(pl), step
        most = max(most, len(pl.cache[LAYER]))
    assert most > 3  # the small experts did make the cache hold more than 3 slots' count


def test_a_uniform_plan_counts_slots_as_before() -> None:
    """No sizes given: every expert a whole slot, the cache bounded by its count."""
    plan = SlotPlan(pins=0, cache_per_layer=2, n_layers=1, work=2, pilot=0)
    pl = Placement(plan, (LAYER,), "lru")
    for e in range(5):
        slot = pl.take()
        pl.fill(slot, (LAYER, e), DEMAND)
        pl.admit(LAYER, e, slot, protected=())
    assert set(pl.cache[LAYER]) == {3, 4} and plan.total == 4
    pl.check(idle=True)


def test_a_read_takes_the_free_slot_whose_pages_fit_it() -> None:
    """A small expert goes to a slot already trimmed to its size, a large one to a whole
    slot: neither faults a trimmed tail back in nor leaves a whole slot's pages idle."""
    pl, _ = placement(cache=2, work=2)
    for e in (4, 5):  # two half-size experts cached: their slots are trimmed to 2 bytes
        assert demand_read(pl, e)
    pl.evict(LAYER, 4)  # its slot is free again, still backed by 2 bytes
    trimmed_slot = pl.free[-1]
    assert pl.backed[trimmed_slot] == 2
    whole = [s for s in pl.free if pl.backed[s] == UNIT]
    assert whole
    large = pl.take((LAYER, 0))
    assert pl.backed[large] == UNIT and large != trimmed_slot
    pl.release(large)
    small = pl.take((LAYER, 6))
    assert small == trimmed_slot and pl.backed[small] == 2
    pl.release(small)
    pl.check(idle=True)


def test_steady_mixed_traffic_moves_no_pages_it_can_avoid() -> None:
    """Seeded traffic of large, half and quarter experts: no read grows a slot's pages
    while a free slot already backed for it exists, and unparking never faults a slot in
    on the spot (its next read does, in the I/O thread)."""
    faults: list[int] = []
    plan = SlotPlan(
        pins=0, cache_per_layer=3, n_layers=1, work=2, pilot=0,
        cache_slots=SIZES.most_per_layer(3, len(KEPT)),
    )  # fmt: skip
    pl = Placement(plan, (LAYER,), "gated-lfru", fault_in=faults.append, sizes=SIZES)
    rng = random.Random(11)
    avoidable = 0
    for _ in range(3000):
        expert = rng.choice(range(len(KEPT)))
        if expert in pl.cache[LAYER]:
            continue
        need = KEPT[expert]
        before = {s: pl.backed[s] for s in pl.free}
        slot = pl.take((LAYER, expert))
        # its pages grew although a free slot already had enough
        avoidable += before[slot] < need and max(before.values()) >= need
        pl.fill(slot, (LAYER, expert), DEMAND)
        pl.admit(LAYER, expert, slot, protected=(), gate=False)
        pl.check(idle=True)
        assert pl.faulted <= budget_bytes(pl)
    assert avoidable == 0
    assert faults == []
