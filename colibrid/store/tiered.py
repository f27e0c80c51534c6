"""The tiered expert store: pinned hot store -> per-layer cache -> disk (DESIGN §3 step 3).

Composed from parts with one job each: :mod:`slots` (which expert is in which slot; no
I/O), :mod:`reader` (extents, slabs, the I/O pool), :mod:`prefetch` (PILOT),
:mod:`recorder` (usage counts), :mod:`pins` (the pin controller) and MEMWATCH. This module
only serves layers: a lookup is a dict hit (pinned, then the layer's cache); the misses
of a layer are all handed to the I/O pool at once, the resident experts are given to the
model first, and each miss is given as its read lands (:meth:`iter_ready`). The model
reduces contributions in ascending expert order, so arrival order cannot change a token.
Everything here runs on the engine thread; reader threads only fill slots.

A failure is contained: whatever raises inside a pass (a read error, a cancel, a bug in
the model), the delivery's clean-up lets its reads land and frees their slots, so the
next request is served exactly as on a fresh store (:meth:`abort_pass`, DESIGN §4).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import replace

from colibrid.errors import CheckpointError, ColibriError
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.experts import ExpertLayout, ExpertWeights
from colibrid.store.pins import PinBudget, PinController, repin_swaps
from colibrid.store.policy import DEFAULT_POLICY
from colibrid.store.prefetch import Prefetcher
from colibrid.store.reader import ExpertReader
from colibrid.store.recorder import UsageRecorder
from colibrid.store.slots import (
    DEMAND,
    FREE,
    HELD,
    LANDED,
    PREFETCH,
    Key,
    Placement,
    SlotPlan,
    StoreError,
)
from colibrid.store.telemetry import Counters, StoreStats, now, snapshot

log = logging.getLogger("colibri.store")

__all__ = ["StoreError", "TieredStore"]


class TieredStore:
    """ExpertStore over disk with a pinned tier and a per-layer cache (see module doc).

    Construct (plans extents from headers only), then :meth:`allocate` once the budget is
    known. ``cache_per_layer`` may later move between 0 and the allocated maximum
    (:meth:`set_cache_per_layer`, MEMWATCH).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        layout: ExpertLayout,
        *,
        direct: bool = True,
        io_threads: int = 4,
        policy: str = DEFAULT_POLICY,
        extra_layers: dict[int, str] | None = None,
    ) -> None:
        self.layout = layout
        self.stats = Counters()
        self.reader = ExpertReader(
            checkpoint,
            layout,
            direct=direct,
            io_threads=io_threads,
            stats=self.stats,
            extra_layers=extra_layers,
        )
        self.extents = self.reader.extents
        self.slot_bytes = self.reader.slot_bytes
        self.expert_bytes = self.reader.expert_bytes
        self.expert_names = self.reader.expert_names
        self.files = self.reader.files
        self.pool = self.reader.pool
        self.policy_name = policy
        self.recorder = UsageRecorder(max(self.extents) + 1, layout.n_experts, self.extents)
        self.counts = self.recorder.counts
        self.profile_path: str | None = None  # where usage is saved after each request
        self.pins = PinController(PinBudget("off", 0, 0))
        self.memwatch = None  # a memwatch.MemWatch when it is on
        self.memwatch_note = "off"
        self.placement: Placement | None = None
        self.prefetcher: Prefetcher | None = None
        self._landed: list[int] = []  # slots whose background read completed
        self._delivery = None  # (generator, waiting reads, owned slots) of the layer served
        self._held: list[tuple[int, int, int]] = []  # (layer, expert, slot) of get_many

    # ---- set-up --------------------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.extents)

    @property
    def n_layers(self) -> int:
        return len(self.extents)

    def payload_bytes(self) -> int:
        return self.reader.payload_bytes()

    def allocate(
        self,
        cache_per_layer: int,
        *,
        work_slots: int | None = None,
        pilot_slots: int = 0,
        pins: Sequence[Key] = (),
        pin_budget: PinBudget | None = None,
    ) -> None:
        """Create the arena from one slot plan, pre-fault what it needs now, load pins."""
        n_exp = self.layout.n_experts
        budget = pin_budget or PinBudget("all" if pins else "off", len(pins), len(pins))
        plan = SlotPlan(
            pins=budget.capacity,
            cache_per_layer=max(0, min(int(cache_per_layer), n_exp)),
            n_layers=self.n_layers,
            work=work_slots if work_slots is not None else min(n_exp, 64),
            pilot=pilot_slots,
        )
        if len(pins) > plan.pins:
            raise StoreError(f"{len(pins)} pins asked for a pin capacity of {plan.pins}")
        self.reader.allocate(plan.total)
        self.placement = Placement(
            plan,
            self.layers,
            self.policy_name,
            fault_in=self.reader.fault_in,
            park=self.reader.park,
        )
        for slot in self.placement.free:  # pre-fault: untouched RAM fills slowly later
            self.reader.fault_in(slot)
        self.prefetcher = Prefetcher(self.placement, self.reader, self.stats)
        self.pins = PinController(budget)
        self.pin(pins)

    # Views of the placement state (tests, telemetry, bench).
    @property
    def cache(self) -> dict[int, dict[int, int]]:
        return self._placed().cache

    @property
    def pinned(self) -> dict[Key, int]:
        return self._placed().pinned

    @property
    def free(self) -> list[int]:
        return self._placed().free

    @property
    def parked(self) -> list[int]:
        return self._placed().parked

    @property
    def pin_on_land(self) -> set[Key]:
        return self._placed().pin_on_land

    @property
    def inflight(self) -> dict[Key, int]:
        return self._pilot().inflight

    @property
    def cache_per_layer(self) -> int:
        return self.placement.cache_per_layer if self.placement is not None else 0

    @property
    def cache_max(self) -> int:
        return self._placed().cache_max

    @property
    def plan(self) -> SlotPlan:
        return self._placed().plan

    def _placed(self) -> Placement:
        if self.placement is None:
            raise StoreError("the store has no memory yet: call allocate()")
        return self.placement

    def _pilot(self) -> Prefetcher:
        assert self.prefetcher is not None, "allocate() first"
        return self.prefetcher

    # ---- pins (PinnedTier for the controller) --------------------------------------------
    def pinned_keys(self) -> list[Key]:
        return list(self._placed().pinned)

    def pin_room(self) -> int:
        return self._placed().pin_room()

    def pin(self, keys: Sequence[Key]) -> None:
        """Load ``keys`` into pinned slots (reads wait here), within the pin capacity."""
        for la, e in keys:
            if (int(la), int(e)) not in self._placed().pinned:
                self.pin_one((int(la), int(e)))

    def pin_one(self, key: Key) -> None:
        pl = self._placed()
        self._quiesce()
        if pl.pin_room() <= 0:
            raise StoreError(f"no pin room left (capacity {pl.plan.pins})")
        slot = pl.uncache(*key)  # already cached: move it, no read
        if slot is None:
            pl.pin_on_land.add(key)  # reserves the pin place: rebalance faults a slot in
            pl.rebalance()
            try:
                slot = pl.take()
                pl.fill(slot, key, DEMAND)
                self.reader.read(slot, key, background=False)
                self._wait_slot(slot)
            except BaseException:
                pl.pin_on_land.discard(key)
                pl.rebalance()
                raise
        pl.settle_pin(key, slot)
        pl.rebalance()

    def unpin(self, key: Key) -> None:
        self._quiesce()
        self._placed().unpin(key)

    def apply_pins(self, counts) -> int:
        """Pin what the controller's rule chooses for ``counts`` (a profile's usage)."""
        keys = self.pins.choose(counts, self.layers)
        return self.pins.apply(self, keys)

    def _quiesce(self) -> None:
        """Between passes: finish the last delivery and admit what landed."""
        self._abandon_delivery()
        self._finish_held()
        self._poll()
        self._drain_landed()

    # ---- completions ---------------------------------------------------------------------
    def _poll(self) -> None:
        """Take every completion already queued (non-blocking) so landed prefetches and
        REPIN reads are admitted before a layer is looked up."""
        while self.reader.completed():
            self._pump()

    def _wait_slot(self, slot: int) -> None:
        pl = self._placed()
        while pl.state[slot] in (DEMAND, PREFETCH):
            self._pump()

    def _pump(self) -> int:
        """Take one completion; returns its slot. Failed background reads are dropped
        quietly, failed demand reads raise once the slot is safe to reuse."""
        pl = self._placed()
        slot, err = self.reader.next_completion()
        if pl.state[slot] == PREFETCH:
            self._landed_background(slot, err)
            return slot
        pl.state[slot] = HELD
        if err is not None:
            self.reader.forget_view(slot)
            pl.release(slot)
            if isinstance(err, ColibriError):
                raise err
            raise CheckpointError(f"expert read failed: {err}") from err
        return slot

    def _pump_quiet(self) -> int:
        """One completion during clean-up: background reads land as usual, a demand read's
        slot is returned for the caller to free (its error is moot now)."""
        slot, err = self.reader.next_completion()
        if self._placed().state[slot] == PREFETCH:
            self._landed_background(slot, err)
        return slot

    def _landed_background(self, slot: int, err: BaseException | None) -> None:
        pl = self._placed()
        key = self._pilot().landed(slot)
        if err is not None:  # a guess or a promotion that failed costs nothing but itself
            if key is not None and key in pl.pin_on_land:
                pl.pin_on_land.discard(key)
            self.reader.forget_view(slot)
            pl.release(slot)
            pl.rebalance()
        else:
            pl.state[slot] = LANDED
            self._landed.append(slot)

    def _drain_landed(self, layer: int = -1, need: set[int] | None = None) -> dict[int, int]:
        """Admit completed background reads to their tiers. Those ``layer`` is about to use
        are handed back instead ({expert: slot}, state HELD): a small cache must not drop
        a correct guess before the layer has used it; the layer admits them afterwards."""
        pl = self._placed()
        landed, self._landed = self._landed, []
        mine: dict[int, int] = {}
        for slot in landed:
            key = pl.slot_key[slot]
            if key is None or pl.state[slot] != LANDED:
                continue
            if key in pl.pin_on_land:
                pl.settle_pin(key, slot)
            elif key in pl.pinned or key[1] in pl.cache[key[0]]:
                pl.release(slot)
            elif need is not None and key[0] == layer and key[1] in need:
                pl.state[slot] = HELD
                mine[key[1]] = slot
            else:
                pl.admit(key[0], key[1], slot, protected=(), prefetched=True)
        return mine

    def _finish_held(self) -> None:
        held, self._held = self._held, []
        for layer, expert, slot in held:
            self._keep(layer, expert, slot, protected=())

    def _keep(self, layer: int, expert: int, slot: int, protected) -> None:
        """A demand-read slot the layer is done with: pinned when REPIN asked for it, else
        admitted to the cache."""
        pl = self._placed()
        if (layer, expert) in pl.pin_on_land:
            pl.settle_pin((layer, expert), slot)
        else:
            pl.admit(layer, expert, slot, protected=protected)

    # ---- the ExpertStore protocol -------------------------------------------------------
    def record(self, layer: int, experts: Sequence[int]) -> None:
        idx = self.recorder.record(layer, experts)
        if self.prefetcher is not None:
            self.prefetcher.score(layer, idx)

    def take_usage(self):
        return self.recorder.take()

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self.get_many(layer, [expert])[0]

    def get_many(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        """Every expert at once, valid until the next store call (misses wait here)."""
        keys = [int(e) for e in experts]
        out: dict[int, ExpertWeights] = {}
        for expert, weights in self._serve(layer, keys, streaming=False):
            out[expert] = weights
        return [out[e] for e in keys]

    def iter_ready(self, layer: int, experts: Sequence[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """(expert, weights) pairs: resident first (ascending), then misses as reads land.

        The lookup and the miss reads happen in this call, not at the first ``next``, so
        the caller can compute something else (the shared expert) while the drive works.
        A yielded expert is valid until the consumer asks for the next one.
        """
        return self._serve(layer, [int(e) for e in experts], streaming=True)

    def _serve(self, layer: int, keys: list[int], streaming: bool):
        """Look the layer up and dispatch its misses now; deliver through a generator."""
        pl, pilot = self._placed(), self._pilot()
        if layer not in self.extents:
            raise KeyError(f"layer {layer} has no routed experts in this store")
        n_exp = self.layout.n_experts
        if any(not 0 <= e < n_exp for e in keys):
            raise KeyError(f"expert out of range [0, {n_exp}) in layer {layer}: {keys}")
        self._abandon_delivery()
        self._finish_held()
        need = set(keys)
        self._poll()
        landed = self._drain_landed(layer, need)
        st, cache, policy = self.stats, pl.cache[layer], pl.policies[layer]
        hits: list[tuple[int, int]] = []
        misses: list[int] = []
        waiting: dict[int, int] = {}  # slot -> expert (reads this layer waits for)
        for e in sorted(need):
            slot = pl.pinned.get((layer, e))
            if slot is not None:
                st.hits_pinned += 1
                hits.append((e, slot))
            elif e in landed:  # PILOT's read landed: use it, keep it afterwards
                st.hits_prefetched += 1
                hits.append((e, landed[e]))
            elif e in cache:
                if (layer, e) in pl.prefetched:
                    pl.prefetched.discard((layer, e))
                    st.hits_prefetched += 1
                else:
                    st.hits_cache += 1
                policy.touch(e)
                hits.append((e, cache[e]))
            elif (layer, e) in pilot.inflight:  # PILOT or REPIN is reading it: wait for it
                st.hits_prefetched += 1
                slot = pilot.claim((layer, e))
                pl.state[slot] = DEMAND
                waiting[slot] = e
            else:
                st.misses += 1
                misses.append(e)
        pilot.withdraw_layer(layer)  # PILOT guessed wrong: don't spend the disk on it now
        owned = set(landed.values())
        pending = list(reversed(misses))
        if not streaming and len(misses) > len(pl.free):
            self._drop_unused(waiting, owned)
            raise StoreError(
                f"layer {layer} needs {len(misses)} reads at once but only {len(pl.free)} "
                "work slots are free; use iter_ready"
            )
        self._dispatch(layer, pending, waiting)
        delivery = self._deliver(layer, hits, owned, waiting, pending, need, streaming)
        self._delivery = (delivery, waiting, owned)
        return delivery

    def _dispatch(self, layer: int, pending: list[int], waiting: dict[int, int]) -> None:
        pl = self._placed()
        while pending and pl.free:
            slot = pl.take()
            expert = pending.pop()
            pl.fill(slot, (layer, expert), DEMAND)
            self.reader.read(slot, (layer, expert), background=False)
            waiting[slot] = expert

    def _abandon_delivery(self) -> None:
        """The previous layer's delivery was dropped unfinished (an exception in the
        model): let its reads land and free their slots before anything else moves."""
        if self._delivery is None:
            return
        delivery, waiting, owned = self._delivery
        self._delivery = None
        delivery.close()  # runs its clean-up when it had started
        self._drop_unused(waiting, owned)  # a no-op then; else it never started

    def _drop_unused(self, waiting: dict[int, int], owned: set[int]) -> None:
        """Free the slots of a delivery that ends early: unused landed guesses at once,
        reads still in flight once they land (a slot must not be reused mid-read)."""
        pl = self._placed()
        for slot in owned:
            pl.release(slot)
        owned.clear()
        for slot in [s for s in waiting if pl.state[s] == FREE]:
            del waiting[slot]  # its read failed and was freed by _pump: nothing will land
        while waiting:
            slot = self._pump_quiet()
            if slot in waiting:
                waiting.pop(slot)
                self.reader.forget_view(slot)
                pl.release(slot)

    def _deliver(self, layer, hits, owned, waiting, pending, need, streaming):
        """``owned``: slots not in a tier yet (landed prefetches, the read in the consumer's
        hands): kept like the layer's own reads once used, freed if the delivery ends
        early."""
        st, pl = self.stats, self._placed()
        try:
            for e, slot in hits:
                t0 = now()
                yield e, self.reader.view(slot, (layer, e))
                st.compute_s += now() - t0
                if slot in owned:
                    owned.discard(slot)
                    self._done_with(layer, e, slot, need, streaming)
            while waiting:
                slot = self._pump()
                if slot not in waiting:
                    continue
                e = waiting.pop(slot)
                pl.state[slot] = HELD
                owned.add(slot)  # in the consumer's hands: freed if it never comes back
                t0 = now()
                yield e, self.reader.view(slot, (layer, e))
                st.compute_s += now() - t0
                owned.discard(slot)
                self._done_with(layer, e, slot, need, streaming)
                self._dispatch(layer, pending, waiting)
            if pending:  # the plan guarantees work slots: never skip an expert silently
                raise StoreError(
                    f"layer {layer}: no slot free for {len(pending)} reads ({pl.plan.describe()})"
                )
        finally:
            self._drop_unused(waiting, owned)  # empty unless abandoned (exception, close)

    def _done_with(self, layer: int, e: int, slot: int, need: set[int], streaming: bool) -> None:
        """A slot this layer read (or PILOT read for it) has been used: keep it in a tier
        now (streaming) or once the caller is done with every expert (get_many)."""
        if streaming:
            need.discard(e)
            self._keep(layer, e, slot, protected=need)
        else:
            self._held.append((layer, e, slot))

    # ---- PILOT ---------------------------------------------------------------------------
    def hint(self, layer: int, experts: Sequence[int]) -> int:
        """Start background reads of predicted experts of ``layer`` (surest first) within
        the plan's PILOT slots; returns reads issued. Never blocks, never evicts."""
        if self.placement is None or layer not in self.extents:
            return 0
        pilot = self._pilot()
        room = self.placement.plan.pilot - len(pilot.inflight) - len(self._landed)
        return pilot.hint(layer, experts, room)

    # ---- boundaries, resizing, telemetry -------------------------------------------------
    def between_tokens(self, wall_s: float = 0.0, attention_s: float = 0.0) -> None:
        """A forward pass ended: admit held experts, count the token and its time."""
        self._finish_held()
        self.stats.io_active_s = self.pool.busy_seconds()
        self.stats.tokens += 1
        self.stats.token_wall_s += wall_s
        self.stats.attention_s += attention_s
        self._pilot().end_pass()
        self.recorder.end_pass()
        if self.memwatch is not None:
            self.memwatch.tick(self)

    def abort_pass(self) -> None:
        """A forward pass raised: end its delivery (reads land, slots free) so the store is
        as consistent as before the pass; called before :meth:`between_tokens`."""
        self._abandon_delivery()
        self._finish_held()

    def request_finished(self) -> None:
        """A request boundary: persist the usage profile, then start the REPIN swaps."""
        self._quiesce()
        usage = self.recorder.profile
        if usage is not None and self.profile_path and usage.dirty:
            usage.save(self.profile_path)
        heat = self.recorder.heat
        if heat is not None and self._placed().pinned:
            for cold, hot in repin_swaps(heat, list(self._placed().pinned)):
                self.repin(cold, hot)

    def repin(self, cold: Key, hot: Key) -> None:
        """Demote ``cold`` to the cache now and promote ``hot`` in the background: a read at
        background priority nobody waits for; ``hot`` is pinned when it lands (or at once
        when it is cached). The pin count never exceeds the capacity."""
        pl, pilot = self._placed(), self._pilot()
        self._quiesce()
        pl.unpin(cold)
        log.info("colibri: repin layer %d: expert %d -> %d", hot[0], cold[1], hot[1])
        slot = pl.uncache(*hot)
        if slot is not None:
            pl.settle_pin(hot, slot)
            pl.rebalance()
            return
        if pl.pin_room() <= 0:
            return
        pl.pin_on_land.add(hot)
        if hot in pilot.inflight:  # PILOT is already reading it: pin it when it lands
            return
        pl.rebalance()
        if pl.spare() <= 0:
            pl.pin_on_land.discard(hot)  # no room after all: skip this swap
            pl.rebalance()
            return
        pilot.start(hot)

    def set_cache_per_layer(self, n: int) -> int:
        """Resize every layer's cache to ``n`` (clamped to what was allocated); evicts the
        coldest entries and gives their pages back, or faults parked slots in again."""
        self._quiesce()
        return self._placed().resize_cache(n)

    def streams(self) -> bool:
        return self.cache_per_layer < self.layout.n_experts

    def check_consistency(self) -> None:
        """Assert the placement bookkeeping is whole (tests; after faults)."""
        self._quiesce()
        self._placed().check(idle=True)

    def resident_bytes(self) -> int:
        pl = self._placed()
        return (pl.n_slots - len(pl.parked)) * self.reader.arena.slot_bytes

    def statistics(self, since: Counters | None = None) -> StoreStats:
        self.stats.io_active_s = self.pool.busy_seconds()
        c = self.stats if since is None else self.stats.minus(since)
        pl = self.placement
        cached = sum(len(x) for x in pl.cache.values()) if pl is not None else 0
        snap = snapshot(
            c,
            cache_per_layer=self.cache_per_layer,
            cache_bytes=cached * self.slot_bytes,
            pinned=len(pl.pinned) if pl is not None else 0,
            io_mode=self.files.mode,
            policy=self.policy_name,
            memwatch=self.memwatch_note,
        )
        return replace(
            snap,
            resident_experts=cached + snap.pinned,
            expert_bytes=self.slot_bytes,
            total_experts=self.n_layers * self.layout.n_experts,
            pin_capacity=self.pins.budget.capacity,
            pin_mode=self.pins.budget.mode,
            pin_note=self.pins.note,
            streams=self.streams(),
        )

    def close(self) -> None:
        if self.memwatch is not None:
            self.memwatch.close()
        self.reader.close()
