"""The tiered expert store: pinned hot store -> per-layer cache -> disk (docs/architecture.md).

Composed from parts with one job each: :mod:`reader` (the checkpoint's experts on disk:
extents, files, the I/O pool), :mod:`tiers` (the memory: the slab arena, :mod:`slots`,
:mod:`prefetch` (PILOT), completions, :mod:`serving`, pin moves), :mod:`recorder` (usage
counts), :mod:`pins` (the pin controller) and MEMWATCH. This module only serves layers:
a lookup is a dict hit (pinned, then the layer's cache); the misses of a layer are all
handed to the I/O pool at once, the resident experts are given to the model first, and
each miss is given as its read lands (:meth:`iter_ready`). The model reduces
contributions in ascending expert order, so arrival order cannot change a token.
Everything here runs on the engine thread; reader threads only fill slots.

Built whole in its constructor: the disk side from the headers, then, from the one
:class:`~colibrid.store.memory_plan.StorePlan` its planner makes (the budget, the KV
size the config gives, the user's knobs), the whole memory side. A store opened without
a planner (tests, tools) gets its memory from :meth:`allocate`, a slot plan made by hand.

A failure is contained: whatever raises inside a pass (a read error, a cancel, a bug in
the model), the delivery's clean-up lets its reads land and frees their slots, so the
next request is served exactly as on a fresh store (:meth:`abort_pass`, docs/architecture.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import replace

from colibrid.backends.base import ResidentExperts
from colibrid.policy import DEFAULT_POLICY
from colibrid.store.budget import BudgetPlan
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.completions import Completions
from colibrid.store.experts import ExpertLayout, ExpertWeights
from colibrid.store.integrity import Digests
from colibrid.store.memory_plan import MemoryPlanner
from colibrid.store.memwatch import MemWatch, default_watch
from colibrid.store.pilot_switch import PilotSwitch
from colibrid.store.pin_moves import PinMoves
from colibrid.store.pins import PinBudget, PinController, repin_swaps
from colibrid.store.prefetch import Prefetcher
from colibrid.store.reader import ExpertReader
from colibrid.store.recorder import UsageRecorder
from colibrid.store.serving import LayerServer
from colibrid.store.slots import Key, Placement, SlotPlan, StoreError
from colibrid.store.telemetry import Counters, StoreStats, snapshot
from colibrid.store.tiers import Tiers

log = logging.getLogger("colibri.store")

__all__ = ["StoreError", "TieredStore"]


class TieredStore:
    """ExpertStore over disk with a pinned tier and a per-layer cache (see module doc).

    ``planner``: the budget, KV size and knobs every slot is planned from (the memory
    side is then built here); without one, :meth:`allocate` with a slot plan made by
    hand. ``cache_per_layer`` may later move
    between 0 and the allocated maximum (:meth:`set_cache_per_layer`, MEMWATCH). With
    ``digests`` each expert's first read from disk is checked against them
    (:mod:`colibrid.store.weight_checks`).
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
        digests: Digests | None = None,
        planner: MemoryPlanner | None = None,
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
            digests=digests,
        )
        self.extents = self.reader.extents
        self.slot_bytes = self.reader.slot_bytes
        self.expert_bytes = self.reader.expert_bytes
        self.files = self.reader.files
        self.pool = self.reader.pool
        self.policy_name = policy
        profiled = [layer for layer in self.extents if layer not in layout.draft_layers]
        self.recorder = UsageRecorder(max(profiled, default=-1) + 1, layout.n_experts, profiled)
        self.counts = self.recorder.counts
        self.pins = PinController(PinBudget("off", 0, 0))
        self.pilot_on = True  # PILOT's slots read guesses (False: lent to the caches)
        # What a plan builds; when the memory is allocated by hand, these say "none":
        self.tiers: Tiers | None = None  # the memory: arena, placement, PILOT, serving
        self.budget_plan: BudgetPlan | None = None  # the budget every slot was planned from
        self.profile_path: str | None = None  # where usage is saved after each request
        self.pilot_switch: PilotSwitch | None = None  # --pilot auto: measures on vs off
        self.memwatch: MemWatch | None = None  # follows free memory, resizes the cache
        if planner is not None:
            try:
                self._build(planner)
            except BaseException:
                self.close()
                raise

    # ---- set-up --------------------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        """The layers usage profiles and pins cover (drafting layers served, not counted)."""
        return tuple(la for la in self.extents if la not in self.layout.draft_layers)

    @property
    def served_layers(self) -> tuple[int, ...]:
        return tuple(self.extents)

    @property
    def n_layers(self) -> int:
        return len(self.extents)

    def payload_bytes(self) -> int:
        return self.reader.payload_bytes()

    def _build(self, planner: MemoryPlanner) -> None:
        """Plan every slot from one budget, allocate, and pin what the pin rule chooses
        from the usage profile; start PILOT's switch and MEMWATCH as planned."""
        plan = planner.plan(
            layers=self.layers,
            n_layers=self.n_layers,
            n_experts=self.layout.n_experts,
            slot_bytes=self.slot_bytes,
        )
        base = plan.budget
        self.budget_plan = base
        self.recorder.learn(plan.usage, heat=plan.repin)
        self.profile_path = plan.save_usage_to
        self.allocate(
            base.cache_per_layer,
            work_slots=base.work_slots,
            pilot_slots=base.pilot_slots,
            pin_budget=plan.pin_budget,
        )
        self.pilot_switch = plan.pilot_switch
        if self.pilot_switch is not None and not self.pilot_switch.on:
            self.set_pilot(False)  # remembered: PILOT costs more than it saves here
        if plan.pin_at_start:
            self.apply_pins(plan.usage.counts)
        if plan.memwatch:
            self.memwatch = default_watch(base.total, self, floor=plan.memory_floor)
        log.info("colibri: %s; %s; pins: %s", base.describe(), self.plan.describe(), self.pins.note)

    def allocate(
        self,
        cache_per_layer: int,
        *,
        work_slots: int | None = None,
        pilot_slots: int = 0,
        pins: Sequence[Key] = (),
        pin_budget: PinBudget | None = None,
    ) -> None:
        """Build the memory side whole from one slot plan (replacing any earlier one),
        pre-fault what it needs now, load ``pins``."""
        n_exp = self.layout.n_experts
        budget = pin_budget or PinBudget("all" if pins else "off", len(pins), len(pins))
        cache = max(0, min(int(cache_per_layer), n_exp))
        sizes = self.reader.sizes
        lendable = pilot_slots // max(1, self.n_layers)  # PILOT's slots lent when off
        plan = SlotPlan(
            pins=budget.capacity,
            cache_per_layer=cache,
            n_layers=self.n_layers,
            work=work_slots if work_slots is not None else min(n_exp, 64),
            pilot=pilot_slots,
            # mixed sizes: a cache of `cache` slots' bytes holds more of the small experts
            cache_slots=sizes.most_per_layer(cache + lendable, n_exp) if sizes.mixed else None,
        )
        if len(pins) > plan.pins:
            raise StoreError(f"{len(pins)} pins asked for a pin capacity of {plan.pins}")
        self.tiers = Tiers(plan, self.reader, self.stats, policy=self.policy_name, n_experts=n_exp)
        self.pins = PinController(budget)
        self.pin(pins)

    def _tiers(self) -> Tiers:
        if self.tiers is None:
            raise StoreError("the store has no memory yet: it was opened without a plan")
        return self.tiers

    # Views of the memory side (tests, telemetry, bench).
    @property
    def placement(self) -> Placement:
        return self._tiers().placement

    @property
    def prefetcher(self) -> Prefetcher:
        return self._tiers().prefetcher

    @property
    def completions(self) -> Completions:
        return self._tiers().completions

    @property
    def server(self) -> LayerServer:
        return self._tiers().server

    @property
    def moves(self) -> PinMoves:
        return self._tiers().moves

    @property
    def pinned(self) -> dict[Key, int]:
        return self.placement.pinned

    @property
    def cache_per_layer(self) -> int:
        return self.tiers.placement.cache_per_layer if self.tiers is not None else 0

    @property
    def cache_max(self) -> int:
        return self.placement.cache_max

    @property
    def plan(self) -> SlotPlan:
        return self.placement.plan

    @property
    def memwatch_note(self) -> str:
        """What `ps` shows of MEMWATCH: its last action, or what it watches."""
        return "off" if self.memwatch is None else self.memwatch.note

    # ---- pins (PinnedTier for the controller) --------------------------------------------
    def pinned_keys(self) -> list[Key]:
        return list(self.placement.pinned)

    def pin(self, keys: Sequence[Key]) -> None:
        """Load ``keys`` into pinned slots (reads wait here), within the pin capacity."""
        for la, e in keys:
            if (int(la), int(e)) not in self.placement.pinned:
                self.moves.pin_one((int(la), int(e)))

    def apply_pins(self, counts) -> int:
        """Pin what the controller's rule chooses for ``counts`` (a profile's usage)."""
        keys = self.pins.choose(counts, self.layers)
        return self.pins.apply(self.moves, keys)

    def _quiesce(self) -> None:
        """Between passes: finish the last delivery and place what landed."""
        self._tiers().quiesce()

    # ---- the ExpertStore protocol -------------------------------------------------------
    def record(self, layer: int, experts: Sequence[int]) -> None:
        if layer in self.layout.draft_layers:
            return  # a drafting layer's selections are no part of the usage profile
        idx = self.recorder.record(layer, experts)
        if self.tiers is not None:
            self.tiers.prefetcher.score(layer, idx)

    def take_usage(self):
        return self.recorder.take()

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self.get_many(layer, [expert])[0]

    def get_many(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        """Every expert at once, valid until the next store call (misses wait here)."""
        keys = [int(e) for e in experts]
        out: dict[int, ExpertWeights] = {}
        for group in self.server.serve(layer, keys, streaming=False):
            out.update(group)
        return [out[e] for e in keys]

    def resident(self, layer: int) -> ResidentExperts | None:
        return None  # experts move between tiers: each layer asks for its own, as it routes

    def iter_groups(
        self, layer: int, experts: Sequence[int]
    ) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """Lists of (expert, weights): first every resident one (ascending, possibly none),
        then each miss as its read lands.

        The lookup and the miss reads happen in this call, not at the first ``next``, so
        the caller can compute something else (the shared expert) while the drive works.
        A list is valid until the consumer asks for the next one.
        """
        groups = self.server.serve(layer, [int(e) for e in experts], streaming=True)
        self._tiers().prefetcher.retry(self._guess_room())  # the lookup freed PILOT slots
        return groups

    def iter_ready(self, layer: int, experts: Sequence[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """`iter_groups` one pair at a time; a pair is valid until the next is asked for."""
        groups = self.iter_groups(layer, experts)
        return (pair for group in groups for pair in group)

    # ---- PILOT ---------------------------------------------------------------------------
    def hint(self, layer: int, experts: Sequence[int]) -> int:
        """Start background reads of predicted experts of ``layer`` (surest first) within
        the plan's PILOT slots; returns reads issued. Never blocks, never evicts."""
        tiers = self.tiers
        if tiers is None or layer not in self.extents:
            return 0
        return tiers.prefetcher.hint(layer, experts, self._guess_room())

    def _guess_room(self) -> int:
        """Reads PILOT may start now: its slots less the guesses in flight (stopping ones
        too) or landed and not placed yet; 0 when off (a guess is still scored: the recall
        stays measured)."""
        tiers = self._tiers()
        if not self.pilot_on:
            return 0
        pilot = tiers.prefetcher
        held = len(pilot.inflight) + len(pilot.stopping) + len(tiers.completions.landed)
        return tiers.placement.pilot_room - held

    def set_pilot(self, on: bool) -> None:
        """PILOT on (its slots read guesses) or off (its slots lent to the caches, one
        more expert per layer for each layer's worth; guesses in flight land first)."""
        self._quiesce()
        tiers = self._tiers()
        pl, pilot, completions = tiers.placement, tiers.prefetcher, tiers.completions
        if not on:
            repin = pl.pin_on_land
            for key in [k for k in pilot.inflight if k not in repin]:
                pilot.withdraw(key)
            while pilot.stopping or any(k not in repin for k in pilot.inflight):
                completions.pump_quiet()
            completions.drain()
        lend = min(
            pl.plan.pilot // max(1, self.n_layers), self.layout.n_experts - pl.plan.cache_per_layer
        )
        pl.lend(0 if on else lend)
        self.pilot_on = on

    # ---- boundaries, resizing, telemetry -------------------------------------------------
    def between_tokens(self, wall_s: float = 0.0, attention_s: float = 0.0, rows: int = 1) -> None:
        """A forward pass ended: admit held experts, count the token and its time."""
        self.server.finish_held()
        if self.pilot_switch is not None:
            on = self.pilot_switch.observe(rows, wall_s)
            if on != self.pilot_on:
                self.set_pilot(on)
        self.stats.io_active_s = self.pool.busy_seconds()
        if rows:  # rows 0: a speculative draft's pass, not a step of any answer
            self.stats.tokens += 1
            self.stats.token_wall_s += wall_s
            self.stats.attention_s += attention_s
        self.prefetcher.end_pass()
        self.recorder.end_pass()
        if self.memwatch is not None:
            self.memwatch.tick(self)

    def abort_pass(self) -> None:
        """A forward pass raised: end its delivery (reads land, slots free) so the store is
        as consistent as before the pass; called before :meth:`between_tokens`."""
        self.server.abandon()
        self.server.finish_held()

    def request_finished(self) -> None:
        """A request boundary: persist the usage profile, then start the REPIN swaps."""
        self._quiesce()
        usage = self.recorder.profile
        if usage is not None and self.profile_path and usage.dirty:
            usage.save(self.profile_path)
        heat = self.recorder.heat
        if heat is not None and self.placement.pinned:
            for cold, hot in repin_swaps(heat, list(self.placement.pinned)):
                self.moves.repin(cold, hot)

    def set_cache_per_layer(self, n: int) -> int:
        """Resize every layer's cache to ``n`` (clamped to what was allocated); evicts the
        coldest entries and gives their pages back, or faults parked slots in again."""
        self._quiesce()
        return self.placement.resize_cache(n)

    def streams(self) -> bool:
        return self.cache_per_layer < self.layout.n_experts

    def reads_experts(self) -> bool:
        return True  # every expert reaches memory through this store's reads

    def check_consistency(self) -> None:
        """Assert the placement bookkeeping is whole (tests; after faults)."""
        self._quiesce()
        self.placement.check(idle=True)

    def resident_bytes(self) -> int:
        return self.placement.faulted  # kept bytes of every slot not parked

    def statistics(self, since: Counters | None = None) -> StoreStats:
        self.stats.io_active_s = self.pool.busy_seconds()
        c = self.stats if since is None else self.stats.minus(since)
        pl = self.tiers.placement if self.tiers is not None else None
        cached = sum(len(x) for x in pl.cache.values()) if pl is not None else 0
        snap = snapshot(
            c,
            cache_per_layer=self.cache_per_layer,
            cache_bytes=pl.cached_bytes() if pl is not None else 0,
            pinned=len(pl.pinned) if pl is not None else 0,
            io_mode=self.files.mode,
            policy=self.policy_name,
            memwatch=self.memwatch_note,
        )
        if self.pilot_switch is not None:
            pilot_note = self.pilot_switch.describe()
        else:
            pilot_note = "on" if pl is not None and pl.plan.pilot else "off"
        return replace(
            snap,
            resident_experts=cached + snap.pinned,
            expert_bytes=self.slot_bytes,
            total_experts=self.n_layers * self.layout.n_experts,
            pin_capacity=self.pins.budget.capacity,
            pin_mode=self.pins.budget.mode,
            pin_note=self.pins.note,
            streams=self.streams(),
            pilot_note=pilot_note,
        )

    def close(self) -> None:
        if self.memwatch is not None:
            self.memwatch.close()
        if self.pilot_switch is not None and self.pilot_switch.memory is not None:
            self.pilot_switch.memory.flush()  # what this run measured, for the next
        self.reader.close()
