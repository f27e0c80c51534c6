"""MEMWATCH: follow live free memory and our RSS; shrink the expert cache when the
machine needs memory, grow it back when memory frees (docs/architecture.md: memory is bounded).

Why between tokens: a sampler thread only *reads* MemAvailable, RSS and the arena's
residency; the resize runs on the engine thread from ``TieredStore.between_tokens``, when
no kernel holds a view of any slot, so eviction can never pull an expert out from under
a matmul. Shrinking evicts each layer's coldest entries (the policy's victims) and hands
their pages back to the kernel (MADV_DONTNEED); growing faults parked slots in again, up
to the size planned at start-up (the ceiling: ``--cache`` or the budget's plan). Thresholds
have a hysteresis band so the cache does not flap.

Why the unfilled plan counts against available memory: slots are pre-faulted with zeros,
and a kernel under pressure may take such pages back without asking (swap, or splitting
zero-filled transparent huge pages), so MemAvailable looks healthy while the cache still
owes itself those bytes and takes them again as experts land — into swap or the OOM
killer. The bytes the plan keeps un-parked but that have no pages (``unfilled``) are
therefore treated as already spent: a hog that leaves too little room for the planned
cache shrinks the plan before the cache fills. Placement never changes tokens, so neither
does any of this.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from colibrid.store.budget import mem_available, process_rss
from colibrid.store.reader import ExpertReader

log = logging.getLogger("colibri.store")
GiB = 1 << 30
MIN_FLOOR = 512 << 20
FLOOR_FRACTION = 0.05
_HEADER = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) ", re.M)
_RSS = re.compile(rb"^Rss:\s+(\d+) kB", re.M)


class WatchedStore(Protocol):
    """What the watch reads of a tiered store, and the one thing it changes (the cache's
    size, between tokens)."""

    reader: ExpertReader  # the arena whose residency is sampled
    slot_bytes: int

    @property
    def n_layers(self) -> int: ...

    @property
    def cache_per_layer(self) -> int: ...

    @property
    def cache_max(self) -> int: ...

    def resident_bytes(self) -> int:
        """Bytes of the slots the plan keeps un-parked."""
        ...

    def set_cache_per_layer(self, n: int) -> int: ...


@dataclass(frozen=True)
class Reading:
    """One look at memory: what the kernel can still hand out, our RSS, and the bytes our
    slot plan keeps un-parked that have no pages right now."""

    available: int
    rss: int
    unfilled: int = 0


def decide(
    *,
    cur: int,
    ceiling: int,
    per_step: int,
    reading: Reading,
    low: int,
    band: int,
    rss_cap: int | None = None,
) -> int:
    """The cache size (experts per layer) for ``reading``; ``cur`` when nothing is needed.

    Room is ``available - unfilled``. Below ``low`` (or RSS over ``rss_cap``) shrink until
    ``low + band`` would be free again (never below 0); above ``low + 2 x band`` grow by
    what fits above ``low + band`` (and under ``rss_cap - band``), never above ``ceiling``.
    Between the two nothing moves: that is the hysteresis band. ``per_step``: the bytes of
    one expert in every layer, what a step of one expert per layer frees or takes.
    """
    per_step, band = max(1, per_step), max(1, band)
    cur = max(0, min(cur, ceiling))
    room = reading.available - reading.unfilled
    over = 0 if rss_cap is None else reading.rss - rss_cap
    if room < low or over > 0:
        short = max(low + band - room, over)
        return max(0, cur - max(1, -(-short // per_step)))
    if cur < ceiling and room > low + 2 * band:
        spare = room - low - band
        if rss_cap is not None:
            spare = min(spare, rss_cap - band - reading.rss)
        if spare >= per_step:
            return min(ceiling, cur + spare // per_step)
    return cur


def mapping_rss(start: int, end: int, smaps: str = "/proc/self/smaps") -> int | None:
    """Resident bytes of our mappings that lie in [start, end) (None without smaps).

    smaps, not mincore: a page the kernel replaced by the shared zero page is still
    "mapped", but it is not in Rss — and that is exactly memory we do not hold."""
    try:
        with open(smaps, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    total, found = 0, False
    for head in _HEADER.finditer(data):
        lo, hi = int(head.group(1), 16), int(head.group(2), 16)
        if hi <= start or lo >= end:
            continue
        rss = _RSS.search(data, head.end())
        if rss is not None:
            total += int(rss.group(1)) * 1024
            found = True
    return total if found else None


def unfilled_planned_bytes(store: WatchedStore) -> int:
    """Bytes of ``store``'s slots the plan keeps un-parked (cache, pins, work, PILOT) that
    have no pages now: never faulted, swapped out, or reclaimed while empty. 0 before the
    store is placed, and when unknown (no /proc: the floor then reads MemAvailable alone)."""
    arena = store.reader.arena
    if arena is None:  # no memory planned yet
        return 0
    start = arena.buf.ctypes.data
    for _ in range(3):  # the engine thread may park or fault a slot meanwhile: read again
        planned = store.resident_bytes()
        rss = mapping_rss(start, start + arena.nbytes)
        if rss is None:
            return 0
        if store.resident_bytes() == planned:
            return max(0, planned - rss)
    return 0


class MemWatch:
    """``low``: below this much room (available minus the unfilled plan), shrink until
    ``low + band`` is free again; above ``low + 2 x band``, grow. ``rss_cap``: shrink while
    our RSS exceeds it. ``unfilled`` is sampled every ``residency_interval_s`` (it reads
    smaps, heavier than MemAvailable)."""

    def __init__(
        self,
        *,
        low: int,
        band: int,
        rss_cap: int | None = None,
        interval_s: float = 0.1,
        available: Callable[[], int] = mem_available,
        rss: Callable[[], int] = process_rss,
        unfilled: Callable[[], int] | None = None,
        residency_interval_s: float = 1.0,
        sample_thread: bool = True,
        note: str | None = None,
    ) -> None:
        self.low, self.band, self.rss_cap = max(0, low), max(band, 1), rss_cap
        # what `ps` shows: what the watch keeps until it acts, then its last action
        self.note = note or f"on: floor {self.low / GiB:.1f} GiB"
        self.available, self.rss = available, rss
        self.unfilled = unfilled or (lambda: 0)
        self.interval_s, self.residency_interval_s = interval_s, residency_interval_s
        self.latest = self.read()
        self.actions: list[str] = []
        self._stop = threading.Event()
        self._thread = None
        if sample_thread:
            self._thread = threading.Thread(
                target=self._sample, name="colibri-memwatch", daemon=True
            )
            self._thread.start()

    def read(self) -> Reading:
        return Reading(self.available(), self.rss(), self.unfilled())

    def _sample(self) -> None:
        unfilled, due = self.latest.unfilled, time.monotonic() + self.residency_interval_s
        while not self._stop.wait(self.interval_s):
            try:
                if time.monotonic() >= due:
                    unfilled, due = self.unfilled(), time.monotonic() + self.residency_interval_s
                self.latest = Reading(self.available(), self.rss(), unfilled)
            except Exception:  # a blind watch must say so, not die silently
                log.exception("colibri: memwatch: sampling failed")

    def tick(self, store: WatchedStore) -> None:
        """Called between tokens; resizes ``store`` when needed."""
        r = self.latest if self._thread is not None else self.read()
        cur, ceiling = store.cache_per_layer, store.cache_max
        new = decide(
            cur=cur,
            ceiling=ceiling,
            per_step=store.n_layers * store.slot_bytes,  # one expert in every layer
            reading=r,
            low=self.low,
            band=self.band,
            rss_cap=self.rss_cap,
        )
        if new == cur:
            return
        store.set_cache_per_layer(new)
        note = (
            f"{'shrink' if new < cur else 'grow'} cache {cur} -> {new} of {ceiling} "
            f"experts/layer (available {r.available / GiB:.2f} GiB, unfilled plan "
            f"{r.unfilled / GiB:.2f} GiB, floor {self.low / GiB:.2f} GiB, RSS "
            f"{r.rss / GiB:.2f} GiB)"
        )
        self.actions.append(note)
        self.note = note
        log.warning("colibri: memwatch: %s", note)
        if self._thread is not None:  # the next decision sees the effect of this one
            self.latest = self.read()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


def default_floor() -> int:
    """5% of RAM, at least 512 MiB: what the rest of the machine keeps by default."""
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(MIN_FLOOR, int(phys * FLOOR_FRACTION))


def default_watch(total_budget: int, store: WatchedStore, *, floor: int | None = None) -> MemWatch:
    """The daemon's watch: ``floor`` bytes kept available (default :func:`default_floor`),
    a band of two experts per layer, RSS capped at the budget, the unfilled plan counted."""
    low = default_floor() if floor is None else floor
    return MemWatch(
        low=low,
        band=2 * store.n_layers * store.slot_bytes,
        rss_cap=total_budget,
        unfilled=lambda: unfilled_planned_bytes(store),
        note=(
            f"on: floor {max(0, low) / GiB:.1f} GiB, cache "
            f"{store.cache_per_layer}/{store.cache_max} experts/layer"
        ),
    )
