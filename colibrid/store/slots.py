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

Mixed precisions (:mod:`colibrid.store.slot_sizes`): a slot holding a smaller expert in a
tier keeps only that expert's bytes, so a layer's cache is bounded in bytes
(``cache_per_layer`` whole slots' worth) and may hold more experts than
``cache_per_layer``; the plan then has more slots (``cache_slots`` a layer), and
:meth:`Placement.rebalance` keeps the memory faulted in, counted in those bytes, within
what the uniform plan of the same budget would fault. With one size every count is the
plain slot count.

Pages changing hands: the counts above are a bound, charged as if a free slot were whole
again. Physically a trimmed slot stays trimmed until a larger read touches its tail, and a
fault of a slot's pages is CPU time (the kernel zeroes them) taken from the cores that
compute. So with mixed sizes a read takes the free slot whose backed pages fit it best (an
int2 expert a slot that held one, an int4 expert a whole one), parking gives back the
least-backed free slot first, and a slot unparked for the plan is left for its next read to
fault in (in the I/O thread, beside the compute) instead of being faulted on the spot: in
steady state no slot's pages change hands.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from colibrid.errors import ColibriError
from colibrid.policy import Policy, make_policy
from colibrid.store.slot_sizes import SlotSizes

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
    cache_slots: int | None = None  # slots a layer's cache may fill (mixed sizes: more)

    def __post_init__(self) -> None:
        for name in ("pins", "cache_per_layer", "n_layers", "work", "pilot"):
            if getattr(self, name) < 0:
                raise StoreError(f"slot plan: {name} must be >= 0, got {getattr(self, name)}")
        if self.work < 1:
            raise StoreError("slot plan: a layer's misses need at least one work slot")

    @property
    def cache_slots_per_layer(self) -> int:
        return max(self.cache_per_layer, self.cache_slots or 0)

    @property
    def total(self) -> int:
        return self.pins + self.cache_slots_per_layer * self.n_layers + self.work + self.pilot

    def describe(self) -> str:
        cache = f"{self.cache_per_layer} x {self.n_layers} cache"
        if self.cache_slots_per_layer > self.cache_per_layer:  # mixed sizes: by bytes
            cache = (
                f"{self.cache_slots_per_layer} x {self.n_layers} cache (the bytes of "
                f"{self.cache_per_layer} largest experts a layer)"
            )
        parts = f"{self.pins} pins + {cache} + {self.work} work + {self.pilot} PILOT"
        return f"{self.total} slots = {parts}"


class Placement:
    """Slot states, the free list, the pinned tier and one cache (with policy) per layer.

    ``fault_in`` / ``park`` / ``trim`` are the arena's page operations (the only side
    effects); ``sizes``: what each expert keeps of a slot (default: a whole one each).
    """

    def __init__(
        self,
        plan: SlotPlan,
        layers: Iterable[int],
        policy: str,
        *,
        fault_in: Callable[[int], None] = lambda slot: None,
        park: Callable[[int], None] = lambda slot: None,
        trim: Callable[[int, int], None] = lambda slot, keep: None,
        sizes: SlotSizes | None = None,
    ) -> None:
        self.plan = plan
        self.sizes = sizes if sizes is not None else SlotSizes()
        self.layers = tuple(layers)
        self.cache_max = plan.cache_per_layer
        self.cache_per_layer = plan.cache_per_layer
        self.lent = 0  # PILOT slots lent to every layer's cache while PILOT is off
        self._fault_in, self._park, self._trim = fault_in, park, trim
        n = max(1, plan.total)
        unit = self.sizes.unit
        self.kept = [unit] * n  # bytes each slot may hold faulted (less once trimmed)
        self.backed = [unit] * n  # bytes it has faulted in now, as far as the core knows
        self.faulted = n * unit  # those bytes summed over the slots not parked
        self.state = [FREE] * n
        self.slot_key: list[Key | None] = [None] * n
        self.free: list[int] = list(range(n - 1, -1, -1))
        self.parked: list[int] = []
        self.cache: dict[int, dict[int, int]] = {layer: {} for layer in self.layers}
        self.cache_used: dict[int, int] = dict.fromkeys(self.layers, 0)  # kept bytes
        self.policies: dict[int, Policy] = {layer: make_policy(policy) for layer in self.layers}
        self.pinned: dict[Key, int] = {}
        self.pin_on_land: set[Key] = set()  # REPIN reads in flight that become pins
        self.prefetched: set[Key] = set()  # cached by PILOT, not used yet
        self.rebalance()

    @property
    def n_slots(self) -> int:
        return len(self.state)

    # ---- slots ----------------------------------------------------------------------
    def take(self, key: Key | None = None) -> int:
        """A free slot for a read of ``key``: with mixed sizes, the one whose backed pages
        fit its bytes best (the fewest pages to fault in or left idle); else the last
        freed."""
        if not self.free:
            raise StoreError(f"no free slot ({self.plan.describe()}): a sizing bug")
        if key is None or not self.sizes.mixed:
            slot = self.free.pop()
        else:
            slot = self.free.pop(self._best_fit(self.sizes.of(key)))
        if key is not None:
            self.backed[slot] = max(self.backed[slot], self.sizes.of(key))
        else:
            self.backed[slot] = self.sizes.unit
        return slot

    def _best_fit(self, need: int) -> int:
        """Index in ``free`` of the smallest backed slot that holds ``need`` bytes, else
        of the most backed one; the most recently freed among equals."""
        best, best_backed = -1, -1
        for i in range(len(self.free) - 1, -1, -1):
            backed = self.backed[self.free[i]]
            if backed == need:
                return i
            fits, best_fits = backed >= need, best_backed >= need
            if best < 0 or (fits and (not best_fits or backed < best_backed)):
                best, best_backed = i, backed
            elif not fits and not best_fits and backed > best_backed:
                best, best_backed = i, backed
        return best

    def release(self, slot: int) -> None:
        self.state[slot] = FREE
        self.slot_key[slot] = None
        # counted whole again: the next read may fill all of it (its tail faults back in)
        self.faulted += self.sizes.unit - self.kept[slot]
        self.kept[slot] = self.sizes.unit
        self.free.append(slot)

    def keep_only(self, slot: int, key: Key) -> None:
        """A slot entering a tier with ``key`` gives back the pages past its bytes."""
        keep = self.sizes.of(key)
        if keep < self.kept[slot]:
            if self.backed[slot] > keep:
                self._trim(slot, keep)
                self.backed[slot] = keep
            self.faulted -= self.kept[slot] - keep
            self.kept[slot] = keep

    @property
    def cache_capacity(self) -> int:
        """A layer's cache bound in kept bytes: ``cache_per_layer`` whole slots."""
        return self.cache_per_layer * self.sizes.unit

    def cached_bytes(self) -> int:
        return sum(self.cache_used.values())

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
        """Park free slots the plan does not need now; fault parked ones in when it does.
        Counted in kept bytes: a tier's trimmed slots leave room for more free ones."""
        unit = self.sizes.unit
        want = min(self.n_slots, self.wanted_faulted()) * unit
        mixed = self.sizes.mixed
        while self.faulted > want and self.free:
            i = min(range(len(self.free)), key=lambda j: self.backed[self.free[j]]) if mixed else 0
            slot = self.free.pop(i)
            if self.backed[slot]:
                self._park(slot)
                self.backed[slot] = 0
            self.parked.append(slot)
            self.faulted -= self.kept[slot]
        while self.faulted + unit <= want and self.parked:
            slot = self.parked.pop()
            if not mixed:  # mixed: its next read faults it in, beside the compute
                self._fault_in(slot)
                self.backed[slot] = unit
            self.free.append(slot)
            self.faulted += self.kept[slot]

    # ---- the cache ------------------------------------------------------------------
    def uncache(self, layer: int, expert: int) -> int | None:
        """Take ``expert`` out of its layer's cache; its slot, or None if not cached."""
        slot = self.cache[layer].pop(expert, None)
        if slot is not None:
            self.cache_used[layer] -= self.sizes.of((layer, expert))
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
        """Put a filled slot into the layer's cache, evicting victims until its bytes fit;
        False = freed. ``gate``: a demand read, which displaces victims only when the
        policy admits it over each of them (else none is evicted)."""
        cache, policy = self.cache[layer], self.policies[layer]
        need = self.sizes.of((layer, expert))
        room = self.cache_capacity - self.cache_used[layer]
        victims: list[int] = []
        skip = set(protected)
        while room < need and len(victims) < len(cache):
            victim = policy.victim(skip)
            if victim is None or (gate and not policy.admits(expert, victim)):
                break
            victims.append(victim)
            skip.add(victim)
            room += self.sizes.of((layer, victim))
        if room < need:
            self.release(slot)
            return False
        for victim in victims:
            self.evict(layer, victim)
        cache[expert] = slot
        self.cache_used[layer] += need
        policy.admit(expert)
        self.fill(slot, (layer, expert), CACHED)
        self.keep_only(slot, (layer, expert))
        if self.sizes.mixed:  # victims and trims moved the bytes: park or unpark slots
            self.rebalance()
        if prefetched:
            self.prefetched.add((layer, expert))
        return True

    def resize_cache(self, n: int) -> int:
        """Every layer's cache to ``n`` (clamped to the plan); evicts the coldest entries."""
        n = max(0, min(int(n), self.cache_max))
        self.cache_per_layer = n
        for layer, cache in self.cache.items():
            while self.cache_used[layer] > self.cache_capacity and cache:
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
        self.keep_only(slot, key)
        self.pinned[key] = slot
        if self.sizes.mixed:
            self.rebalance()

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
            used = sum(self.sizes.of((layer, e)) for e in cache)
            assert used == self.cache_used[layer], f"layer {layer} cache bytes drift"
            assert used <= self.cache_capacity, f"layer {layer} cache over its size"
            assert len(cache) <= self.plan.cache_slots_per_layer + self.lent, (
                f"layer {layer} cache holds more experts than it has slots"
            )
            assert len(cache) == len(self.policies[layer]), f"layer {layer} policy drift"
            for expert, slot in cache.items():
                claim(slot, f"cached {(layer, expert)}")
                assert self.state[slot] == CACHED and self.slot_key[slot] == (layer, expert)
                assert (layer, expert) not in self.pinned, f"{(layer, expert)} pinned and cached"
        assert len(self.pinned) + len(self.pin_on_land) <= self.plan.pins, "pins over budget"
        parked = set(self.parked)
        faulted = sum(k for s, k in enumerate(self.kept) if s not in parked)
        assert faulted == self.faulted, f"faulted bytes drift: {faulted} != {self.faulted}"
        for slot in range(self.n_slots):
            if self.state[slot] not in (CACHED, PINNED):
                assert self.kept[slot] == self.sizes.unit, f"slot {slot} trimmed out of a tier"
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
