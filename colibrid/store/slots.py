"""The placement core: which expert is in which slot, and in which tier. No I/O.

Why a pure core: every rule that can corrupt a token lives here (a slot holding two
experts, a tier taking the slots a layer's reads need), so it is kept free of files and
threads and checked by :meth:`Placement.check` after any failure in tests.

Slot plan (all counts of slots): ``pins + cache_per_layer x layers + work + pilot``.
Each part is a bound, not a partition: any free slot may carry any expert, but the
pinned tier never holds more than ``pins`` and each layer's cache never more than
``cache_per_layer``, so whenever no layer is being served at least ``work + pilot``
slots are free or parked — a layer's misses always find their slots. Slots the plan
does not need right now (pin room not yet used, cache MEMWATCH shrank) are *parked*:
their pages are given back to the kernel until :meth:`Placement.rebalance` faults them
in again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from colibrid.errors import ColibriError
from colibrid.policy import Policy, make_policy

FREE, DEMAND, PREFETCH, LANDED, CACHED, PINNED, HELD = range(7)
STATE_NAMES = ("free", "demand", "prefetch", "landed", "cached", "pinned", "held")

Key = tuple[int, int]  # (layer, expert)


class StoreError(ColibriError):
    """The store cannot serve as configured: a sizing bug the plan should have prevented."""


@dataclass(frozen=True)
class SlotPlan:
    """How many slots each part of the store may use; fixed when the store allocates."""

    pins: int
    cache_per_layer: int
    n_layers: int
    work: int
    pilot: int

    def __post_init__(self) -> None:
        for name in ("pins", "cache_per_layer", "n_layers", "work", "pilot"):
            if getattr(self, name) < 0:
                raise StoreError(f"slot plan: {name} must be >= 0, got {getattr(self, name)}")
        if self.work < 1:
            raise StoreError("slot plan: a layer's misses need at least one work slot")

    @property
    def total(self) -> int:
        return self.pins + self.cache_per_layer * self.n_layers + self.work + self.pilot

    def describe(self) -> str:
        return (
            f"{self.total} slots = {self.pins} pins + {self.cache_per_layer} x "
            f"{self.n_layers} cache + {self.work} work + {self.pilot} PILOT"
        )


class Placement:
    """Slot states, the free list, the pinned tier and one cache (with policy) per layer.

    ``fault_in`` / ``park`` are the arena's page operations (the only side effects).
    """

    def __init__(
        self,
        plan: SlotPlan,
        layers: Iterable[int],
        policy: str,
        *,
        fault_in: Callable[[int], None] = lambda slot: None,
        park: Callable[[int], None] = lambda slot: None,
    ) -> None:
        self.plan = plan
        self.layers = tuple(layers)
        self.cache_max = plan.cache_per_layer
        self.cache_per_layer = plan.cache_per_layer
        self.lent = 0  # PILOT slots lent to every layer's cache while PILOT is off
        self._fault_in, self._park = fault_in, park
        n = max(1, plan.total)
        self.state = [FREE] * n
        self.slot_key: list[Key | None] = [None] * n
        self.free: list[int] = list(range(n - 1, -1, -1))
        self.parked: list[int] = []
        self.cache: dict[int, dict[int, int]] = {layer: {} for layer in self.layers}
        self.policies: dict[int, Policy] = {layer: make_policy(policy) for layer in self.layers}
        self.pinned: dict[Key, int] = {}
        self.pin_on_land: set[Key] = set()  # REPIN reads in flight that become pins
        self.prefetched: set[Key] = set()  # cached by PILOT, not used yet
        self.rebalance()

    @property
    def n_slots(self) -> int:
        return len(self.state)

    # ---- slots ----------------------------------------------------------------------
    def take(self) -> int:
        if not self.free:
            raise StoreError(f"no free slot ({self.plan.describe()}): a sizing bug")
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.state[slot] = FREE
        self.slot_key[slot] = None
        self.free.append(slot)

    def fill(self, slot: int, key: Key, state: int) -> None:
        self.state[slot] = state
        self.slot_key[slot] = key

    @property
    def pilot_room(self) -> int:
        """Slots PILOT may read into now: its plan share less what is lent to the caches."""
        return self.plan.pilot - self.lent * len(self.layers)

    def lend(self, per_layer: int) -> int:
        """Lend PILOT's slots to the caches, ``per_layer`` more experts each (at most what
        the PILOT share covers), or 0 to take them back (evicting each layer's coldest);
        returns what is lent. A cache MEMWATCH shrank stays as it is, under the new
        ceiling."""
        per_layer = max(0, min(int(per_layer), self.plan.pilot // max(1, len(self.layers))))
        at_ceiling = self.cache_per_layer >= self.cache_max
        self.lent = per_layer
        self.cache_max = self.plan.cache_per_layer + per_layer
        if at_ceiling or self.cache_per_layer > self.cache_max:
            self.resize_cache(self.cache_max)
        else:
            self.rebalance()
        return per_layer

    def spare(self) -> int:
        """Free slots beyond the work slots a layer's misses may need (PILOT, REPIN)."""
        return len(self.free) - self.plan.work

    def wanted_faulted(self) -> int:
        """Slots that must have pages: what the tiers may hold now plus work and PILOT."""
        pins = len(self.pinned) + len(self.pin_on_land)
        cache = self.cache_per_layer * len(self.layers)
        return pins + cache + self.plan.work + self.pilot_room

    def rebalance(self) -> None:
        """Park free slots the plan does not need now; fault parked ones in when it does."""
        want = min(self.n_slots, self.wanted_faulted())
        while self.n_slots - len(self.parked) > want and self.free:
            slot = self.free.pop(0)
            self._park(slot)
            self.parked.append(slot)
        while self.n_slots - len(self.parked) < want and self.parked:
            slot = self.parked.pop()
            self._fault_in(slot)
            self.free.append(slot)

    # ---- the cache ------------------------------------------------------------------
    def uncache(self, layer: int, expert: int) -> int | None:
        """Take ``expert`` out of its layer's cache; its slot, or None if not cached."""
        slot = self.cache[layer].pop(expert, None)
        if slot is not None:
            self.policies[layer].remove(expert)
            self.prefetched.discard((layer, expert))
        return slot

    def evict(self, layer: int, expert: int) -> None:
        slot = self.uncache(layer, expert)
        if slot is not None:
            self.release(slot)

    def admit(
        self,
        layer: int,
        expert: int,
        slot: int,
        protected: Iterable[int],
        *,
        prefetched: bool = False,
        gate: bool = False,
    ) -> bool:
        """Put a filled slot into the layer's cache, evicting victims; False = freed.
        ``gate``: a demand read, which displaces a victim only when the policy admits it."""
        cache, policy = self.cache[layer], self.policies[layer]
        while len(cache) >= self.cache_per_layer and cache:
            victim = policy.victim(protected)
            if victim is None or (gate and not policy.admits(expert, victim)):
                break
            self.evict(layer, victim)
        if len(cache) >= self.cache_per_layer:
            self.release(slot)
            return False
        cache[expert] = slot
        policy.admit(expert)
        self.fill(slot, (layer, expert), CACHED)
        if prefetched:
            self.prefetched.add((layer, expert))
        return True

    def resize_cache(self, n: int) -> int:
        """Every layer's cache to ``n`` (clamped to the plan); evicts the coldest entries."""
        n = max(0, min(int(n), self.cache_max))
        self.cache_per_layer = n
        for layer, cache in self.cache.items():
            while len(cache) > n:
                victim = self.policies[layer].victim(())
                if victim is None:
                    break
                self.evict(layer, victim)
        self.rebalance()
        return n

    # ---- the pinned tier ------------------------------------------------------------
    def pin_room(self) -> int:
        return self.plan.pins - len(self.pinned) - len(self.pin_on_land)

    def settle_pin(self, key: Key, slot: int) -> None:
        self.pin_on_land.discard(key)
        if len(self.pinned) >= self.plan.pins:
            raise StoreError(f"pin budget of {self.plan.pins} exceeded: a sizing bug")
        self.fill(slot, key, PINNED)
        self.pinned[key] = slot

    def unpin(self, key: Key) -> None:
        """Move a pinned expert into its layer's cache (or free it when there is no room)."""
        slot = self.pinned.pop(key)
        self.admit(key[0], key[1], slot, protected=())
        self.rebalance()

    # ---- checks ---------------------------------------------------------------------
    def check(self, *, idle: bool = True) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent. ``idle``: no layer
        is being served and no demand read is in flight (then every slot is free, parked,
        in a tier, or a PILOT/REPIN read in flight or landed)."""
        seen: dict[int, str] = {}

        def claim(slot: int, where: str) -> None:
            assert slot not in seen, f"slot {slot} is both {seen[slot]} and {where}"
            seen[slot] = where

        for slot in self.free:
            claim(slot, "free")
            assert self.state[slot] == FREE, f"free slot {slot} is {STATE_NAMES[self.state[slot]]}"
        for slot in self.parked:
            claim(slot, "parked")
            assert self.state[slot] == FREE
        for key, slot in self.pinned.items():
            claim(slot, f"pinned {key}")
            assert self.state[slot] == PINNED and self.slot_key[slot] == key
        for layer, cache in self.cache.items():
            assert len(cache) <= self.cache_per_layer, f"layer {layer} cache over its size"
            assert len(cache) == len(self.policies[layer]), f"layer {layer} policy drift"
            for expert, slot in cache.items():
                claim(slot, f"cached {(layer, expert)}")
                assert self.state[slot] == CACHED and self.slot_key[slot] == (layer, expert)
                assert (layer, expert) not in self.pinned, f"{(layer, expert)} pinned and cached"
        assert len(self.pinned) + len(self.pin_on_land) <= self.plan.pins, "pins over budget"
        if idle:
            background = (PREFETCH, LANDED)
            busy = [
                s for s in range(self.n_slots) if s not in seen and self.state[s] not in background
            ]
            assert not busy, (
                f"slots {busy} are neither free nor in a tier while idle: "
                f"{[(STATE_NAMES[self.state[s]], self.slot_key[s]) for s in busy]}"
            )
            assert len(self.free) + len(self.parked) >= self.plan.work, "work slots taken"
