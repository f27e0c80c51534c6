"""The tiered expert store: pinned hot store -> per-layer cache -> disk (DESIGN §3 step 3).

Why this shape: dense weights stay resident elsewhere; routed experts live in fixed-size
slots of one pre-faulted arena (:mod:`slabs`). A lookup is a dict hit (pinned, then the
layer's cache); the misses of a layer are all handed to the I/O pool at once, the
resident experts are given to the model first, and each miss is given as its read lands
(:meth:`iter_ready`). The model reduces contributions in ascending expert order, so
arrival order cannot change a token. Everything that decides placement runs on the
engine thread; reader threads only fill slots.

Slot accounting (all counts of slots): pins + cache_per_layer x layers + work + pilot.
The work slots hold the misses of the current layer until they are admitted to the
cache (evicting the policy's victim, never an expert the layer still needs — upstream's
"swap the ws buffer into the LRU"). With ``iter_ready`` a union larger than the work
slots streams through them; ``get_many`` (which must keep every returned expert valid
until the next call) needs all its misses in work slots at once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import numpy as np

from colibrid.errors import CheckpointError, ColibriError
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.experts import ExpertLayout, ExpertWeights
from colibrid.store.extents import ExpertExtents, ExtentPlanner
from colibrid.store.io_pool import BACKGROUND, DEMAND_READ, IOPool, ReadFiles
from colibrid.store.policy import DEFAULT_POLICY, Policy, make_policy
from colibrid.store.slabs import SlabArena
from colibrid.store.telemetry import Counters, StoreStats, now, snapshot

log = logging.getLogger("colibri.store")

FREE, DEMAND, PREFETCH, LANDED, CACHED, PINNED, HELD = range(7)


class StoreError(ColibriError):
    """The store cannot serve a request as configured (e.g. too few work slots)."""


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
        planner = ExtentPlanner(checkpoint, layout)
        templates = {layer: layout.name_template for layer in layout.moe_layers}
        templates.update(extra_layers or {})
        self.extents: dict[int, list[ExpertExtents]] = {
            layer: [planner.plan(layer, e, t) for e in range(layout.n_experts)]
            for layer, t in sorted(templates.items())
        }
        self.expert_names = {
            layout.tensor_name(la, e, p, t) + sfx
            for la, t in templates.items()
            for e in range(layout.n_experts)
            for p in ("gate_proj", "up_proj", "down_proj")
            for sfx in ("", ".qs")
        }
        self.slot_bytes = max(x.slab_bytes for row in self.extents.values() for x in row)
        self.expert_bytes = max(x.payload_bytes for row in self.extents.values() for x in row)
        self.files = ReadFiles(planner.files, direct=direct)
        self.pool = IOPool(self.files, io_threads)
        self.policy_name = policy
        self.counts = np.zeros((max(self.extents) + 1, layout.n_experts), dtype=np.int64)
        self.usage = None  # a UsageProfile when learning is on (set by the engine)
        self.profile_path: str | None = None  # where usage is saved after each request
        self.repinner = None  # a pinning.Repinner when REPIN is on
        self.memwatch = None  # a memwatch.MemWatch when it is on
        self.stats = Counters()
        self.memwatch_note = "off"
        self.arena: SlabArena | None = None
        self._landed: list[int] = []  # slots whose prefetch read completed
        self._delivery = None  # (generator, waiting reads, owned slots) of the layer served
        self.pin_on_land: set[tuple[int, int]] = set()  # background REPIN reads in flight
        self._predictions: dict[int, set[int]] = {}  # PILOT's guess per layer, for recall

    # ---- set-up --------------------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.extents)

    @property
    def n_layers(self) -> int:
        return len(self.extents)

    def payload_bytes(self) -> int:
        return sum(x.payload_bytes for row in self.extents.values() for x in row)

    def allocate(
        self,
        cache_per_layer: int,
        *,
        work_slots: int | None = None,
        pilot_slots: int = 0,
        pins: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Create the arena (pre-faulted) and load the pins."""
        n_exp = self.layout.n_experts
        self.cache_max = max(0, min(int(cache_per_layer), n_exp))
        self.cache_per_layer = self.cache_max
        self.work_slots = work_slots if work_slots is not None else min(n_exp, 64)
        self.pilot_slots = pilot_slots
        n = len(pins) + self.cache_max * self.n_layers + self.work_slots + pilot_slots
        self.arena = SlabArena(self.slot_bytes, max(1, n))
        self.state = [FREE] * self.arena.n_slots
        self.slot_key: list[tuple[int, int] | None] = [None] * self.arena.n_slots
        self.free: list[int] = list(range(self.arena.n_slots - 1, -1, -1))
        self.parked: list[int] = []  # slots whose pages MEMWATCH gave back
        self.cache: dict[int, dict[int, int]] = {layer: {} for layer in self.extents}
        self.policies: dict[int, Policy] = {
            la: make_policy(self.policy_name) for la in self.extents
        }
        self.prefetched: set[tuple[int, int]] = set()  # cached by PILOT, not yet used
        self.inflight: dict[tuple[int, int], int] = {}  # key -> slot (prefetch reads)
        self.pinned: dict[tuple[int, int], int] = {}
        self._views: list[tuple[tuple[int, int] | None, ExpertWeights | None]] = [
            (None, None)
        ] * self.arena.n_slots
        self._held: list[tuple[int, int, int]] = []  # (layer, expert, slot) of get_many
        self.pin(pins)

    def pin(self, keys: Sequence[tuple[int, int]]) -> None:
        """Load ``keys`` into pinned slots (parallel reads; waits for all)."""
        todo = [(int(la), int(e)) for la, e in keys if (la, e) not in self.pinned]
        for layer, expert in todo:
            slot = self._uncache(layer, expert)  # already in the cache: move it, no read
            if slot is None:
                if len(self.free) <= self.work_slots + self.pilot_slots:
                    raise StoreError("no free slot to pin into (the rest are work slots)")
                slot = self._take_slot()
                self._read(slot, layer, expert, DEMAND)
                self._wait_slot(slot)
            self._settle_pin((layer, expert), slot)

    def unpin(self, key: tuple[int, int]) -> None:
        """Move a pinned expert into its layer's cache (or free it when there is no room)."""
        slot = self.pinned.pop(key)
        self._admit(key[0], key[1], slot, protected=())

    # ---- slots ---------------------------------------------------------------------------
    def _take_slot(self) -> int | None:
        return self.free.pop() if self.free else None

    def _release(self, slot: int) -> None:
        self.state[slot] = FREE
        self.slot_key[slot] = None
        self.free.append(slot)

    def _uncache(self, layer: int, expert: int) -> int | None:
        """Take ``expert`` out of its layer's cache; its slot, or None if not cached."""
        slot = self.cache[layer].pop(expert, None)
        if slot is not None:
            self.policies[layer].remove(expert)
            self.prefetched.discard((layer, expert))
        return slot

    def _read(self, slot: int, layer: int, expert: int, kind: int) -> None:
        ext = self.extents[layer][expert]
        self.state[slot] = kind
        self.slot_key[slot] = (layer, expert)
        self.stats.bytes_read += ext.read_bytes
        self.pool.submit(
            slot,
            ext.reads,
            self.arena.memview(slot),
            BACKGROUND if kind == PREFETCH else DEMAND_READ,
        )

    def _withdraw(self, key: tuple[int, int]) -> bool:
        """Cancel a background read no worker has started; frees its slot."""
        slot = self.inflight[key]
        if not self.pool.cancel(slot):
            return False
        del self.inflight[key]
        nbytes = self.extents[key[0]][key[1]].read_bytes
        self.stats.bytes_read -= nbytes
        self.stats.prefetch_bytes -= nbytes
        self.stats.pilot_cancelled += 1
        self._release(slot)
        return True

    def _poll(self) -> None:
        """Take every completion already queued (non-blocking) so landed prefetches and
        REPIN reads are admitted before a layer is looked up."""
        while not self.pool.done.empty():
            self._pump()

    def _wait_slot(self, slot: int) -> None:
        while self.state[slot] in (DEMAND, PREFETCH):
            self._pump()

    def _pump(self) -> int:
        """Take one completion; returns its slot. Failed prefetches are dropped quietly,
        failed demand reads raise once the slot is safe to reuse."""
        t0 = now()
        tag, _n, err = self.pool.done.get()
        self.stats.io_wait_s += now() - t0
        if self.state[tag] == PREFETCH:
            self._landed_background(tag, err)
            return tag
        self.state[tag] = HELD
        if err is not None:
            self._release(tag)
            if isinstance(err, ColibriError):
                raise err
            raise CheckpointError(f"expert read failed: {err}") from err
        return tag

    def _landed_background(self, slot: int, err: BaseException | None) -> None:
        key = self.slot_key[slot]
        if key is not None:
            self.inflight.pop(key, None)
        if err is not None:  # a guess or a promotion that failed costs nothing but itself
            if key is not None:
                self.pin_on_land.discard(key)
            self._release(slot)
        else:
            self.state[slot] = LANDED
            self._landed.append(slot)

    def _view(self, slot: int) -> ExpertWeights:
        key = self.slot_key[slot]
        cached_key, weights = self._views[slot]
        if cached_key != key or weights is None:
            assert key is not None
            weights = self.extents[key[0]][key[1]].views(self.arena.slot(slot))
            self._views[slot] = (key, weights)
        return weights

    def _admit(
        self, layer: int, expert: int, slot: int, protected, *, prefetched: bool = False
    ) -> bool:
        """Put a filled slot into the layer's cache, evicting victims; False = freed."""
        cache, policy = self.cache[layer], self.policies[layer]
        while len(cache) >= self.cache_per_layer and cache:
            victim = policy.victim(protected)
            if victim is None:
                break
            self._evict(layer, victim)
        if len(cache) >= self.cache_per_layer:
            self._release(slot)
            return False
        cache[expert] = slot
        policy.admit(expert)
        self.state[slot] = CACHED
        self.slot_key[slot] = (layer, expert)
        if prefetched:
            self.prefetched.add((layer, expert))
        return True

    def _evict(self, layer: int, expert: int) -> None:
        self._release(self._uncache(layer, expert))

    def _finish_held(self) -> None:
        held, self._held = self._held, []
        for layer, expert, slot in held:
            self._keep(layer, expert, slot, protected=())

    def _keep(self, layer: int, expert: int, slot: int, protected) -> None:
        """A demand-read slot the layer is done with: pinned when REPIN asked for it,
        else admitted to the cache."""
        if (layer, expert) in self.pin_on_land:
            self._settle_pin((layer, expert), slot)
        else:
            self._admit(layer, expert, slot, protected=protected)

    def _settle_pin(self, key: tuple[int, int], slot: int) -> None:
        self.pin_on_land.discard(key)
        self.state[slot] = PINNED
        self.slot_key[slot] = key
        self.pinned[key] = slot

    def _drain_landed(self, layer: int = -1, need: set[int] | None = None) -> dict[int, int]:
        """Admit completed prefetches to their caches. Those ``layer`` is about to use are
        handed back instead ({expert: slot}, state HELD): a small cache must not drop a
        correct guess before the layer has used it; the layer admits them afterwards,
        like its own reads."""
        landed, self._landed = self._landed, []
        mine: dict[int, int] = {}
        for slot in landed:
            key = self.slot_key[slot]
            if key is None or self.state[slot] != LANDED:
                continue
            if key in self.pin_on_land:
                self._settle_pin(key, slot)
            elif key in self.pinned or key[1] in self.cache[key[0]]:
                self._release(slot)
            elif need is not None and key[0] == layer and key[1] in need:
                self.state[slot] = HELD
                mine[key[1]] = slot
            else:
                self._admit(key[0], key[1], slot, protected=(), prefetched=True)
        return mine

    # ---- the ExpertStore protocol -------------------------------------------------------
    def record(self, layer: int, experts: Sequence[int]) -> None:
        if layer not in self.extents:
            raise KeyError(f"layer {layer} has no routed experts in this store")
        idx = np.asarray(experts, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.layout.n_experts):
            raise KeyError(f"expert index out of range in {list(idx)}")
        np.add.at(self.counts[layer], idx, 1)
        if self.usage is not None:
            self.usage.record(layer, idx)
        if self.repinner is not None:
            self.repinner.record(layer, idx)
        self._score_pilot(layer, idx)

    def _score_pilot(self, layer: int, idx: np.ndarray) -> None:
        predicted = self._predictions.pop(layer, None)
        if predicted is not None:
            chosen = set(idx.tolist())
            self.stats.pilot_chosen += len(chosen)
            self.stats.pilot_correct += len(chosen & predicted)

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

    def _serve(
        self, layer: int, keys: list[int], streaming: bool
    ) -> Iterator[tuple[int, ExpertWeights]]:
        """Look the layer up and dispatch its misses now; deliver through a generator."""
        if self.arena is None:
            raise StoreError("the store has no memory yet: call allocate()")
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
        st, cache, policy = self.stats, self.cache[layer], self.policies[layer]
        hits: list[tuple[int, int]] = []
        misses: list[int] = []
        waiting: dict[int, int] = {}  # slot -> expert (reads this layer waits for)
        for e in sorted(need):
            slot = self.pinned.get((layer, e))
            if slot is not None:
                st.hits_pinned += 1
                hits.append((e, slot))
            elif e in landed:  # PILOT's read landed: use it, keep it afterwards
                st.hits_prefetched += 1
                hits.append((e, landed[e]))
            elif e in cache:
                if (layer, e) in self.prefetched:
                    self.prefetched.discard((layer, e))
                    st.hits_prefetched += 1
                else:
                    st.hits_cache += 1
                policy.touch(e)
                hits.append((e, cache[e]))
            elif (layer, e) in self.inflight:  # PILOT is reading it: wait for that read
                st.hits_prefetched += 1
                slot = self.inflight.pop((layer, e))
                self.state[slot] = DEMAND
                self.pool.promote(slot)
                waiting[slot] = e
            else:
                st.misses += 1
                misses.append(e)
        for key in [k for k in self.inflight if k[0] == layer and k not in self.pin_on_land]:
            self._withdraw(key)  # PILOT guessed wrong: don't spend the disk on it now
        if not streaming and len(misses) > len(self.free):
            raise StoreError(
                f"layer {layer} needs {len(misses)} reads at once but only "
                f"{len(self.free)} work slots are free; use iter_ready"
            )
        pending = list(reversed(misses))
        while pending and self.free:
            slot = self.free.pop()
            self._read(slot, layer, pending.pop(), DEMAND)
            waiting[slot] = self.slot_key[slot][1]  # type: ignore[index]
        owned = set(landed.values())
        delivery = self._deliver(layer, hits, owned, waiting, pending, need, streaming)
        self._delivery = (delivery, waiting, owned)
        return delivery

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
        for slot in owned:
            self._release(slot)
        owned.clear()
        while waiting:
            slot = self._pump_quiet()
            if slot in waiting:
                waiting.pop(slot)
                self._release(slot)

    def _deliver(
        self,
        layer: int,
        hits: list[tuple[int, int]],
        owned: set[int],
        waiting: dict[int, int],
        pending: list[int],
        need: set[int],
        streaming: bool,
    ) -> Iterator[tuple[int, ExpertWeights]]:
        """``owned``: hit slots that are not in a tier yet (landed prefetches): they are
        kept like the layer's own reads once used."""
        st = self.stats
        try:
            for e, slot in hits:
                t0 = now()
                yield e, self._view(slot)
                st.compute_s += now() - t0
                if slot in owned:
                    owned.discard(slot)
                    self._done_with(layer, e, slot, need, streaming)
            while waiting:
                slot = self._pump()
                if slot not in waiting:
                    continue
                e = waiting.pop(slot)
                self.state[slot] = HELD
                t0 = now()
                yield e, self._view(slot)
                st.compute_s += now() - t0
                self._done_with(layer, e, slot, need, streaming)
                while pending and self.free:
                    nslot = self.free.pop()
                    self._read(nslot, layer, pending.pop(), DEMAND)
                    waiting[nslot] = self.slot_key[nslot][1]  # type: ignore[index]
                if pending and not waiting:
                    raise StoreError(f"layer {layer}: no slot free for {len(pending)} reads")
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

    def _pump_quiet(self) -> int:
        """Take one completion during clean-up: background reads land as usual, a demand
        read's slot is returned for the caller to free (its error is moot now)."""
        tag, n, err = self.pool.done.get()
        if self.state[tag] == PREFETCH:
            self._landed_background(tag, err)
        return tag

    # ---- PILOT ---------------------------------------------------------------------------
    def hint(self, layer: int, experts: Sequence[int]) -> int:
        """Start background reads of predicted experts of ``layer``, in the order given
        (surest first); returns reads issued.

        Never blocks, never evicts: a read needs a free slot beyond the work slots, and it
        is admitted to the cache only when ``layer`` is next served.
        """
        if self.arena is None or layer not in self.extents:
            return 0
        order = list(dict.fromkeys(int(e) for e in experts))
        predicted = set(order)
        self._predictions[layer] = predicted
        issued = 0
        for e in order:
            key = (layer, e)
            if key in self.pinned or e in self.cache[layer] or key in self.inflight:
                continue
            if len(self.free) <= self.work_slots or self.cache_per_layer == 0:
                break
            slot = self.free.pop()
            self._read(slot, layer, e, PREFETCH)
            self.inflight[key] = slot
            self.stats.prefetch_bytes += self.extents[layer][e].read_bytes
            issued += 1
        self.stats.pilot_loads += issued
        self.stats.pilot_predicted += len(predicted)
        return issued

    # ---- boundaries, resizing, telemetry -------------------------------------------------
    def between_tokens(self, wall_s: float = 0.0, attention_s: float = 0.0) -> None:
        """A forward pass ended: admit held experts, count the token and its time."""
        self._finish_held()
        self.stats.io_active_s = self.pool.busy_seconds()
        self.stats.tokens += 1
        self.stats.token_wall_s += wall_s
        self.stats.attention_s += attention_s
        self._predictions.clear()
        if self.usage is not None:
            self.usage.end_forward()
        if self.memwatch is not None:
            self.memwatch.tick(self)

    def request_finished(self) -> None:
        """A request boundary: persist the usage profile, then start the REPIN swaps."""
        self._finish_held()
        if self.usage is not None and self.profile_path and self.usage.dirty:
            self.usage.save(self.profile_path)
        if self.repinner is not None and self.pinned:
            for cold, hot in self.repinner.swaps(list(self.pinned)):
                self.repin(cold, hot)

    def repin(self, cold: tuple[int, int], hot: tuple[int, int]) -> None:
        """Demote ``cold`` to the cache now and promote ``hot`` in the background: a read
        at background priority that nobody waits for; the expert becomes pinned when the
        read lands (or at once when it is already cached). Slot count is conserved: the
        demoted slot (or the cache victim it displaced) carries the new pin."""
        self.unpin(cold)
        layer, expert = hot
        log.info("colibri: repin layer %d: expert %d -> %d", layer, cold[1], expert)
        slot = self._uncache(layer, expert)
        if slot is not None:
            self._settle_pin(hot, slot)
            return
        self.pin_on_land.add(hot)
        if hot in self.inflight:  # PILOT is already reading it: pin it when it lands
            return
        if len(self.free) <= self.work_slots + self.pilot_slots:
            self.pin_on_land.discard(hot)  # no room after all: skip this swap
            return
        slot = self.free.pop()
        self._read(slot, layer, expert, PREFETCH)
        self.inflight[hot] = slot

    def set_cache_per_layer(self, n: int) -> int:
        """Resize every layer's cache to ``n`` (clamped to what was allocated); evicts the
        coldest entries and gives their pages back, or faults parked slots in again."""
        n = max(0, min(int(n), self.cache_max))
        self._finish_held()
        self._drain_landed()
        if n < self.cache_per_layer:
            self.cache_per_layer = n
            for layer, cache in self.cache.items():
                while len(cache) > n:
                    victim = self.policies[layer].victim(())
                    if victim is None:
                        break
                    self._evict(layer, victim)
            keep = self.work_slots + self.pilot_slots
            target_free = keep + (self.cache_max - n) * self.n_layers
            while len(self.free) > keep and len(self.parked) < target_free - keep:
                slot = self.free.pop(0)
                self.arena.release(slot)
                self.parked.append(slot)
        elif n > self.cache_per_layer:
            want = (n - self.cache_per_layer) * self.n_layers
            for _ in range(min(want, len(self.parked))):
                slot = self.parked.pop()
                self.arena.fault_in(slot)
                self.free.append(slot)
            self.cache_per_layer = n
        return n

    def resident_bytes(self) -> int:
        assert self.arena is not None
        return (self.arena.n_slots - len(self.parked)) * self.arena.slot_bytes

    def statistics(self, since: Counters | None = None) -> StoreStats:
        self.stats.io_active_s = self.pool.busy_seconds()
        c = self.stats if since is None else self.stats.minus(since)
        cache_bytes = (
            sum(len(x) for x in self.cache.values()) * self.slot_bytes
            if self.arena is not None
            else 0
        )
        return snapshot(
            c,
            cache_per_layer=getattr(self, "cache_per_layer", 0),
            cache_bytes=cache_bytes,
            pinned=len(getattr(self, "pinned", {})),
            io_mode=self.files.mode,
            policy=self.policy_name,
            memwatch=self.memwatch_note,
        )

    def close(self) -> None:
        if self.memwatch is not None:
            self.memwatch.close()
        self.pool.close()
        self.files.close()
