"""MEMWATCH: follow live free memory and our RSS; shrink the expert cache when the
machine needs memory, grow it back when memory frees (DESIGN §4: never OOM-killed).

Why between tokens: a sampler thread only *reads* MemAvailable and RSS; the resize runs
on the engine thread from ``TieredStore.between_tokens``, when no kernel holds a view of
any slot, so eviction can never pull an expert out from under a matmul. Shrinking evicts
each layer's coldest entries (the policy's victims) and hands their pages back to the
kernel (MADV_DONTNEED); growing faults parked slots in again, up to the size planned at
start-up. Thresholds have a hysteresis band so the cache does not flap.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from colibrid.store.budget import mem_available, process_rss

log = logging.getLogger("colibri.store")
GiB = 1 << 30


class MemWatch:
    """``low``: below this much available memory, shrink until ``low + band`` is free
    again; above ``low + 2 x band``, grow. ``rss_cap``: shrink while our RSS exceeds it."""

    def __init__(
        self,
        *,
        low: int,
        band: int,
        rss_cap: int | None = None,
        interval_s: float = 0.1,
        available: Callable[[], int] = mem_available,
        rss: Callable[[], int] = process_rss,
        sample_thread: bool = True,
    ) -> None:
        self.low, self.band, self.rss_cap = low, max(band, 1), rss_cap
        self.available, self.rss = available, rss
        self.interval_s = interval_s
        self.latest = (available(), rss())
        self.actions: list[str] = []
        self._stop = threading.Event()
        self._thread = None
        if sample_thread:
            self._thread = threading.Thread(
                target=self._sample, name="colibri-memwatch", daemon=True
            )
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.latest = (self.available(), self.rss())

    def tick(self, store: Any) -> None:
        """Called between tokens; resizes ``store`` (a TieredStore) when needed."""
        avail, rss = self.latest if self._thread is not None else (self.available(), self.rss())
        per_step = max(1, store.n_layers * store.slot_bytes)  # one expert in every layer
        cur = store.cache_per_layer
        new = cur
        if avail < self.low or (self.rss_cap is not None and rss > self.rss_cap):
            short = max(
                self.low + self.band - avail, 0 if self.rss_cap is None else rss - self.rss_cap
            )
            new = max(0, cur - max(1, -(-short // per_step)))
        elif avail > self.low + 2 * self.band and cur < store.cache_max:
            new = min(store.cache_max, cur + max(1, (avail - self.low - self.band) // per_step))
        if new == cur:
            return
        store.set_cache_per_layer(new)
        note = (
            f"{'shrink' if new < cur else 'grow'} cache {cur} -> {new} experts/layer "
            f"(available {avail / GiB:.2f} GiB, RSS {rss / GiB:.2f} GiB)"
        )
        self.actions.append(note)
        store.memwatch_note = note
        log.warning("colibri: memwatch: %s", note)
        if self._thread is not None:  # the next decision sees the effect of this one
            self.latest = (self.available(), self.rss())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


def default_watch(total_budget: int, store: Any) -> MemWatch:
    """Keep at least 5% of RAM (>= 512 MiB) available; band of two experts per layer."""
    import os

    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    low = max(512 << 20, phys // 20)
    band = 2 * store.n_layers * store.slot_bytes
    return MemWatch(low=low, band=band, rss_cap=total_budget)
