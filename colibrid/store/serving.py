"""Serving one layer: look its experts up, dispatch the misses, deliver as reads land.

Why a generator: the lookup and the miss reads happen when the layer asks, so the model
computes the shared expert while the drive works; resident experts are given first
(ascending), misses as they land, each valid until the next is asked for. Whatever way
a delivery ends (used up, dropped, an exception in the model) its clean-up lets the
reads in flight land and frees every slot that did not reach a tier.
"""

from __future__ import annotations

from colibrid.store.completions import Completions
from colibrid.store.extents import ExpertExtents
from colibrid.store.prefetch import Prefetcher
from colibrid.store.reader import ExpertReader
from colibrid.store.slots import DEMAND, FREE, HELD, Placement, StoreError
from colibrid.store.telemetry import Counters, now


class LayerServer:
    def __init__(
        self,
        placement: Placement,
        reader: ExpertReader,
        prefetcher: Prefetcher,
        completions: Completions,
        stats: Counters,
        extents: dict[int, list[ExpertExtents]],
        n_experts: int,
    ) -> None:
        self.placement = placement
        self.reader = reader
        self.prefetcher = prefetcher
        self.completions = completions
        self.stats = stats
        self.extents = extents
        self.n_experts = n_experts
        self._delivery = None  # (generator, waiting reads, owned slots) of the layer served
        self._held: list[tuple[int, int, int]] = []  # (layer, expert, slot) of get_many
        # demand misses per layer since the store opened (`bench stream`'s per-layer line:
        # one layer missing more than its neighbours points at PILOT or the cache)
        self.misses_by_layer: dict[int, int] = dict.fromkeys(extents, 0)

    def serve(self, layer: int, keys: list[int], streaming: bool):
        """Look the layer up and dispatch its misses now; deliver through a generator."""
        pl, pilot = self.placement, self.prefetcher
        if layer not in self.extents:
            raise KeyError(f"layer {layer} has no routed experts in this store")
        n_exp = self.n_experts
        if any(not 0 <= e < n_exp for e in keys):
            raise KeyError(f"expert out of range [0, {n_exp}) in layer {layer}: {keys}")
        self.abandon()
        self.finish_held()
        need = set(keys)
        self.completions.poll()
        landed = self.completions.drain(layer, need)
        st, cache, policy = self.stats, pl.cache[layer], pl.policies[layer]
        row = self.extents[layer]
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
                st.needed_bytes += row[e].read_bytes
                policy.seen(e)
                hits.append((e, landed[e]))
            elif e in cache:
                if (layer, e) in pl.prefetched:
                    pl.prefetched.discard((layer, e))
                    st.hits_prefetched += 1
                    st.needed_bytes += row[e].read_bytes
                else:
                    st.hits_cache += 1
                policy.touch(e)
                hits.append((e, cache[e]))
            elif (layer, e) in pilot.inflight:  # PILOT or REPIN is reading it: wait for it
                st.hits_prefetched += 1
                st.needed_bytes += row[e].read_bytes
                policy.seen(e)
                slot = pilot.claim((layer, e))
                pl.state[slot] = DEMAND
                waiting[slot] = e
            else:
                st.misses += 1
                self.misses_by_layer[layer] += 1
                st.needed_bytes += row[e].read_bytes
                policy.seen(e)
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
        pl = self.placement
        while pending and pl.free:
            expert = pending.pop()
            slot = pl.take((layer, expert))
            pl.fill(slot, (layer, expert), DEMAND)
            self.reader.read(slot, (layer, expert), background=False)
            waiting[slot] = expert

    def abandon(self) -> None:
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
        pl = self.placement
        for slot in owned:
            pl.release(slot)
        owned.clear()
        for slot in [s for s in waiting if pl.state[s] == FREE]:
            del waiting[slot]  # its read failed and was freed by _pump: nothing will land
        while waiting:
            slot = self.completions.pump_quiet()
            if slot in waiting:
                waiting.pop(slot)
                pl.release(slot)

    def _deliver(self, layer, hits, owned, waiting, pending, need, streaming):
        """``owned``: slots not in a tier yet (landed prefetches, the read in the consumer's
        hands): kept like the layer's own reads once used, freed if the delivery ends
        early."""
        st, pl = self.stats, self.placement
        try:
            t0 = now()
            yield [(e, self.reader.view(slot, (layer, e))) for e, slot in hits]
            st.compute_s += now() - t0
            for e, slot in hits:
                if slot in owned:
                    owned.discard(slot)
                    self._done_with(layer, e, slot, need, streaming)
            while waiting:
                slot = self.completions.pump()
                if slot not in waiting:
                    continue
                e = waiting.pop(slot)
                pl.state[slot] = HELD
                owned.add(slot)  # in the consumer's hands: freed if it never comes back
                t0 = now()
                yield [(e, self.reader.view(slot, (layer, e)))]
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
            self.completions.keep(layer, e, slot, protected=need)
        else:
            self._held.append((layer, e, slot))

    def finish_held(self) -> None:
        held, self._held = self._held, []
        for layer, expert, slot in held:
            self.completions.keep(layer, expert, slot, protected=())
