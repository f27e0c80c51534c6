"""Gated LFRU: every use counts, cached or not, and a missed expert enters the cache only
over a colder one.

Why: LFRU (lfru.py) counts an expert's uses only while it is cached, and the store admits
every demand read, so with a few slots per layer each step's misses push out whatever the
cache held, hot or not: the cache ends each step holding the step's last reads. Here a
miss is a use too (heat and recency kept for every expert the layer has asked for), and a
demand read displaces the coldest resident only when its own score is higher (the
admission gate of TinyLFU-style caches); otherwise it is used once and dropped. Scores are
LFRU's: (heat << 8) | recency, heat halved every ``decay_every`` uses (256: a shorter memory
than LFRU's 4096, which replays of demo and synthetic GLM-5 traces preferred at every cache
size tried). On a recorded demo trace at 2 experts per layer it reads 7% fewer experts than
LFRU for one request at a time and 2% fewer for four decoded together (figures in
``DEFAULT_POLICY``'s note).

A prefetched expert (PILOT's guess, a pinned expert moved down) is admitted ungated and
counts no use until the model asks for it.
"""

from __future__ import annotations

import heapq
from collections.abc import Container

from colibrid.policy.lfru import LFRU


class GatedLFRU(LFRU):
    def __init__(self, decay_every: int = 256) -> None:
        super().__init__(decay_every)

    def seen(self, key: int) -> None:
        self._use(key)

    def admit(self, key: int) -> None:
        """Residency only: the use was counted when the layer asked (seen or touch)."""
        self._resident[key] = None
        self._used.setdefault(key, self._clock)

    def admits(self, key: int, victim: int) -> bool:
        return self.score(key) > self.score(victim)


class HeatGatedLFRU(GatedLFRU):
    """Gated LFRU whose gate compares heat alone (TinyLFU's rule): a newcomer displaces the
    coldest resident only when it has been used more, so under a uniform working set
    larger than the capacity the held set stays put instead of turning over every use.
    The victim is the resident with the least (heat, last use), found in a heap instead of
    a scan, as the device tier holds thousands of expert weights.

    Why a second gate: with recency in the score, a newcomer wins every tie of heat,
    which the per-layer RAM caches' replays preferred (``DEFAULT_POLICY``'s note). The
    device tier (backends/device_tier.py) sees every layer's uses and pays a bus copy
    for each admission; on the demo streamed at 8 experts a layer with 0.12 GB of device
    memory (`colibri bench stream --backend cuda`, emulated device) it served 57.2% of
    weight uses and copied 0.061 GB a token, against 51.9% and 0.070 GB with recency in
    the gate."""

    def __init__(self, decay_every: int = 256) -> None:
        super().__init__(decay_every)
        self._heap: list[tuple[int, int, int]] = []  # (heat, last use, key); stale kept

    def _use(self, key: int) -> None:
        super()._use(key)
        if self._clock % self._decay_every == 0:
            self._rebuild()  # every heat halved: the stored orders are stale
        elif key in self._resident:
            self._push(key)

    def admit(self, key: int) -> None:
        super().admit(key)
        self._push(key)

    def _push(self, key: int) -> None:
        heapq.heappush(self._heap, (self.heat(key), self._used[key], key))
        if len(self._heap) > 4 * len(self._resident) + 64:
            self._rebuild()  # mostly stale entries: start again from the residents

    def _rebuild(self) -> None:
        self._heap = [(self.heat(k), self._used.get(k, 0), k) for k in self._resident]
        heapq.heapify(self._heap)

    def _current(self, entry: tuple[int, int, int]) -> bool:
        heat, used, key = entry
        return key in self._resident and heat == self.heat(key) and used == self._used.get(key)

    def victim(self, protected: Container[int] = ()) -> int | None:
        skipped = []
        found = None
        while self._heap:
            entry = self._heap[0]
            if not self._current(entry):
                heapq.heappop(self._heap)
            elif entry[2] in protected:
                skipped.append(heapq.heappop(self._heap))
            else:
                found = entry[2]
                break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found

    def admits(self, key: int, victim: int) -> bool:
        return self.heat(key) > self.heat(victim)
