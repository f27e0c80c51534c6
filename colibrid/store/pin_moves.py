"""The pinned tier's moves: pin an expert (moved from the cache, or read and waited
for), unpin it into the cache, and REPIN's swap (the hot expert read in the background
and pinned when it lands). The pin controller decides; this only moves, always within
the capacity the slot plan reserved.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from colibrid.store.completions import Completions
from colibrid.store.prefetch import Prefetcher
from colibrid.store.reader import ExpertReader
from colibrid.store.slots import DEMAND, Key, Placement, StoreError

log = logging.getLogger("colibri.store")


class PinMoves:
    """A :class:`colibrid.store.pins.PinnedTier` over the placement (engine thread only)."""

    def __init__(
        self,
        placement: Placement,
        reader: ExpertReader,
        prefetcher: Prefetcher,
        completions: Completions,
        quiesce: Callable[[], None],
    ) -> None:
        self.placement = placement
        self.reader = reader
        self.prefetcher = prefetcher
        self.completions = completions
        self.quiesce = quiesce  # finish the last delivery and place what landed

    def pinned_keys(self) -> list[Key]:
        return list(self.placement.pinned)

    def pin_room(self) -> int:
        return self.placement.pin_room()

    def pin_one(self, key: Key) -> None:
        pl = self.placement
        self.quiesce()
        if pl.pin_room() <= 0:
            raise StoreError(f"no pin room left (capacity {pl.plan.pins})")
        slot = pl.uncache(*key)  # already cached: move it, no read
        if slot is None:
            pl.pin_on_land.add(key)  # reserves the pin place: rebalance faults a slot in
            pl.rebalance()
            try:
                slot = pl.take(key)
                pl.fill(slot, key, DEMAND)
                self.reader.read(slot, key, background=False)
                self.completions.wait_slot(slot)
            except BaseException:
                pl.pin_on_land.discard(key)
                pl.rebalance()
                raise
        pl.settle_pin(key, slot)
        pl.rebalance()

    def unpin(self, key: Key) -> None:
        self.quiesce()
        self.placement.unpin(key)

    def repin(self, cold: Key, hot: Key) -> None:
        """Demote ``cold`` to the cache now and promote ``hot`` in the background: a read at
        background priority nobody waits for; ``hot`` is pinned when it lands (or at once
        when it is cached). The pin count never exceeds the capacity."""
        pl, pilot = self.placement, self.prefetcher
        self.quiesce()
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
