"""A full cache admits a demand read hotter than its coldest resident, and only that.

Why here: the placement invariance suites compare tokens, which a cache that never
admits anything still gets right (it only reads more), and the policy tests call the
policy alone. These drive :meth:`Placement.admit` the way the layer server does for a
miss (the lookup counted as a use, the read into a work slot, then offered to the cache
over its coldest resident), so a gate that never opens fails here.
"""

from __future__ import annotations

import pytest

from colibrid.store.slots import DEMAND, FREE, Placement, SlotPlan

LAYER = 0
GATED = ["gated-lfru", "heat-gated-lfru"]  # gated-lfru: the store's default (DEFAULT_POLICY)


def demand_read(pl: Placement, expert: int, uses: int = 1) -> bool:
    """What serving a miss does: ``uses`` lookups counted, the read lands in a work
    slot, the layer is done with it and offers it to the cache; whether it stayed."""
    for _ in range(uses):
        pl.policies[LAYER].seen(expert)
    slot = pl.take()
    pl.fill(slot, (LAYER, expert), DEMAND)
    return pl.admit(LAYER, expert, slot, protected=(), gate=True)


def full_cache(policy: str) -> Placement:
    """A layer cache of two, full: expert 0 then expert 1, each used twice."""
    plan = SlotPlan(pins=0, cache_per_layer=2, n_layers=1, work=2, pilot=0)
    pl = Placement(plan, (LAYER,), policy)
    assert demand_read(pl, 0, uses=2) and demand_read(pl, 1, uses=2)  # room: no gate
    assert set(pl.cache[LAYER]) == {0, 1}
    return pl


@pytest.mark.parametrize("policy", GATED)
def test_a_full_cache_admits_a_hotter_read_over_its_coldest(policy: str) -> None:
    pl = full_cache(policy)
    free = len(pl.free)
    assert demand_read(pl, 5, uses=3)  # used three times: hotter than either resident
    assert set(pl.cache[LAYER]) == {1, 5}  # 0, the coldest (least recently used), left
    slot = pl.cache[LAYER][5]
    assert pl.slot_key[slot] == (LAYER, 5) and pl.state[slot] != FREE
    assert len(pl.free) == free  # the read's slot became the cache's, the victim's freed
    pl.check(idle=True)


@pytest.mark.parametrize("policy", GATED)
def test_a_full_cache_drops_a_colder_read(policy: str) -> None:
    pl = full_cache(policy)
    free = len(pl.free)
    assert not demand_read(pl, 7)  # used once: colder than both residents
    assert set(pl.cache[LAYER]) == {0, 1}
    assert len(pl.free) == free  # used once and dropped: its slot is free again
    pl.check(idle=True)


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_an_ungated_policy_admits_every_read(policy: str) -> None:
    pl = full_cache(policy)
    assert demand_read(pl, 7)
    assert 7 in pl.cache[LAYER] and len(pl.cache[LAYER]) == 2
    pl.check(idle=True)
