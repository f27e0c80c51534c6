"""Completions: what the I/O pool reports back, and where each landed read goes.

Why apart: a completion is the only moment a slot's bytes become valid, and each kind
has its own destination (a demand read to the layer waiting for it, a PILOT guess to
its layer's cache or to the layer about to use it, a REPIN read to the pinned tier); a
failed background read costs nothing but itself. Runs on the engine thread only.
"""

from __future__ import annotations

from colibrid.errors import CheckpointError, ColibriError
from colibrid.store.prefetch import Prefetcher
from colibrid.store.reader import ExpertReader
from colibrid.store.slots import DEMAND, HELD, LANDED, PREFETCH, Placement


class Completions:
    def __init__(self, placement: Placement, reader: ExpertReader, prefetcher: Prefetcher) -> None:
        self.placement = placement
        self.reader = reader
        self.prefetcher = prefetcher
        self.landed: list[int] = []  # slots whose background read completed, not yet placed

    def poll(self) -> None:
        """Take every completion already queued (non-blocking) so landed prefetches and
        REPIN reads are admitted before a layer is looked up."""
        while self.reader.completed():
            self.pump()

    def wait_slot(self, slot: int) -> None:
        pl = self.placement
        while pl.state[slot] in (DEMAND, PREFETCH):
            self.pump()

    def pump(self) -> int:
        """Take one completion; returns its slot. Failed background reads are dropped
        quietly, failed demand reads raise once the slot is safe to reuse."""
        pl = self.placement
        slot, err = self.reader.next_completion()
        if pl.state[slot] == PREFETCH:
            self._landed_background(slot, err)
            return slot
        pl.state[slot] = HELD
        if err is not None:
            pl.release(slot)
            if isinstance(err, ColibriError):
                raise err
            raise CheckpointError(f"expert read failed: {err}") from err
        return slot

    def pump_quiet(self) -> int:
        """One completion during clean-up: background reads land as usual, a demand read's
        slot is returned for the caller to free (its error is moot now)."""
        slot, err = self.reader.next_completion()
        if self.placement.state[slot] == PREFETCH:
            self._landed_background(slot, err)
        return slot

    def _landed_background(self, slot: int, err: BaseException | None) -> None:
        pl = self.placement
        key = self.prefetcher.landed(slot)
        if err is not None:  # a guess or a promotion that failed costs nothing but itself
            if key is not None and key in pl.pin_on_land:
                pl.pin_on_land.discard(key)
            pl.release(slot)
            pl.rebalance()
        else:
            pl.state[slot] = LANDED
            self.landed.append(slot)

    def drain(self, layer: int = -1, need: set[int] | None = None) -> dict[int, int]:
        """Admit completed background reads to their tiers. Those ``layer`` is about to use
        are handed back instead ({expert: slot}, state HELD): a small cache must not drop
        a correct guess before the layer has used it; the layer admits them afterwards."""
        pl = self.placement
        landed, self.landed = self.landed, []
        mine: dict[int, int] = {}
        for slot in landed:
            key = pl.slot_key[slot]
            if key is None or pl.state[slot] != LANDED:
                continue
            if key in pl.pin_on_land:
                pl.settle_pin(key, slot)
            elif key in pl.pinned or key[1] in pl.cache[key[0]]:
                pl.release(slot)
            elif key[0] == layer and key[1] in mine:  # read twice (a guess landed, unplaced,
                pl.release(slot)  # when the next token guessed it again): keep one copy
            elif need is not None and key[0] == layer and key[1] in need:
                pl.state[slot] = HELD
                mine[key[1]] = slot
            else:
                pl.admit(key[0], key[1], slot, protected=(), prefetched=True)
        return mine

    def keep(self, layer: int, expert: int, slot: int, protected) -> None:
        """A demand-read slot the layer is done with: pinned when REPIN asked for it, else
        admitted to the cache."""
        pl = self.placement
        if (layer, expert) in pl.pin_on_land:
            pl.settle_pin((layer, expert), slot)
        else:
            pl.admit(layer, expert, slot, protected=protected, gate=True)
