"""PILOT's side of the store: background reads of the experts a layer is predicted to
choose, withdrawn unread (or stopped part-way) when the router disagrees, and the recall
score.

Why it never blocks or evicts: a guess may only use slots beyond the work slots (the
plan's PILOT share), and is admitted to a cache only after its layer has used it, so a
wrong guess costs disk time at background priority and nothing else.

Why a guess waits for the next lookup: layer L+1 is guessed before layer L is looked up,
while L's own guesses still hold PILOT's slots; the ones L did not choose are withdrawn
or placed by that lookup. Without a second try, every other layer got only the slots
its predecessor's guesses left (and missed more often than the layers around it:
docs/performance.md), so the experts that found no room are started once more right
after the lookup, before the layer computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from colibrid.store.reader import ExpertReader
from colibrid.store.slots import PREFETCH, Key, Placement
from colibrid.store.telemetry import Counters


class Prefetcher:
    def __init__(self, placement: Placement, reader: ExpertReader, stats: Counters) -> None:
        self.placement = placement
        self.reader = reader
        self.stats = stats
        self.inflight: dict[Key, int] = {}  # key -> slot of a background read
        self.stopping: set[int] = set()  # slots of wrong guesses asked to stop
        self._predictions: dict[int, set[int]] = {}  # guess per layer, for recall
        self._unstarted: tuple[int, list[int]] | None = None  # the last guess's rest

    def hint(self, layer: int, experts: Sequence[int], room: int) -> int:
        """Start at most ``room`` background reads of ``experts`` of ``layer`` (surest
        first); returns the number of reads issued. What found no room is kept for
        :meth:`retry` (the last guess's only)."""
        order = list(dict.fromkeys(int(e) for e in experts))
        self._predictions[layer] = set(order)
        self.stats.pilot_predicted += len(order)
        issued, rest = self._start_guesses(layer, order, room)
        self._unstarted = (layer, rest) if rest else None
        return issued

    def retry(self, room: int) -> int:
        """A lookup has freed slots: start what the last guess could not, within
        ``room``; returns the reads issued. Tried once: what still finds no room is
        dropped."""
        if self._unstarted is None:
            return 0
        layer, rest = self._unstarted
        self._unstarted = None
        return self._start_guesses(layer, rest, room)[0]

    def _start_guesses(self, layer: int, experts: list[int], room: int) -> tuple[int, list[int]]:
        """Start reads of ``experts`` not held or in flight, at most ``room``; returns
        (reads issued, the experts left when room or free slots ran out)."""
        pl = self.placement
        issued, rest = 0, []
        if pl.cache_per_layer == 0:  # nowhere to keep a guess once its layer used it
            return issued, rest
        for i, e in enumerate(experts):
            key = (layer, e)
            if key in pl.pinned or e in pl.cache[layer] or key in self.inflight:
                continue
            if issued >= room or pl.spare() <= 0:
                rest = experts[i:]
                break
            self.start(key)
            issued += 1
        self.stats.pilot_loads += issued
        return issued, rest

    def start(self, key: Key) -> int:
        """A background read of ``key`` into a free slot (PILOT's guess or a REPIN)."""
        slot = self.placement.take(key)
        self.placement.fill(slot, key, PREFETCH)
        self.reader.read(slot, key, background=True)
        self.inflight[key] = slot
        return slot

    def withdraw(self, key: Key) -> bool:
        """Cancel a background read no worker has started; frees its slot."""
        slot = self.inflight[key]
        if not self.reader.withdraw(slot, key):
            return False
        del self.inflight[key]
        self.stats.pilot_cancelled += 1
        self.placement.release(slot)
        return True

    def withdraw_layer(self, layer: int) -> None:
        """The layer has chosen: its guesses in flight (not REPIN's) are not worth reading;
        the unstarted are withdrawn, the running stopped (their slot is freed when the
        stopped read reports: until then the key is no longer in flight, so the next
        token may read it again into another slot)."""
        keep = self.placement.pin_on_land
        for key in [k for k in self.inflight if k[0] == layer and k not in keep]:
            if not self.withdraw(key):
                self._stop(key)
        if self._unstarted is not None and self._unstarted[0] == layer:
            self._unstarted = None

    def _stop(self, key: Key) -> None:
        """Stop a running read of ``key`` (no-op once it has finished: it lands)."""
        slot = self.inflight[key]
        if self.reader.stop(slot):
            del self.inflight[key]
            self.stopping.add(slot)

    def claim(self, key: Key) -> int | None:
        """The layer needs ``key`` and a background read of it is in flight: the layer
        takes that read over (promoted to demand priority); its slot, or None."""
        slot = self.inflight.pop(key, None)
        if slot is not None:
            self.reader.promote(slot)
        return slot

    def landed(self, slot: int) -> Key | None:
        key = self.placement.slot_key[slot]
        self.stopping.discard(slot)
        if key is not None and self.inflight.get(key) == slot:
            del self.inflight[key]
        return key

    def score(self, layer: int, chosen: np.ndarray) -> None:
        predicted = self._predictions.pop(layer, None)
        if predicted is not None:
            picked = set(chosen.tolist())
            self.stats.pilot_chosen += len(picked)
            self.stats.pilot_correct += len(picked & predicted)

    def end_pass(self) -> None:
        self._predictions.clear()
        self._unstarted = None
