"""The device tier: which weights a backend keeps copies of in its own memory (GPU memory
for cuda, MLX arrays for mlx), under a byte budget, least recently used out first.

A weight not held is copied (converted) at its use. Which weights are held never changes
a result: a backend computes the same arithmetic on the same copy wherever the weight came
from, so placement stays token-invariant (docs/architecture.md). What is resident on the
host for good (the dense weights, pinned and cached experts) is used every token and
stays held; a streamed expert is copied once per read from disk, over a bus faster than
the disk that brought it. A copy goes when its weight object goes (a streamed expert's
view dies with its slot's fill), so the tier never serves stale bytes. `ps` and /metrics
show it through `Ops.device_tier()`.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from colibrid.backends.base import DeviceTierStats
from colibrid.errors import BackendError, first_line
from colibrid.formats.weights import QuantWeight

T = TypeVar("T")  # a backend's copy of a weight
A = TypeVar("A")  # whatever an allocation returns


class DeviceTier(Generic[T]):
    """Copies of weights by weight object, made by ``copy`` and ``size(copy)`` bytes each,
    least recently used out first once their bytes pass ``budget`` (None: no budget). An
    evicted copy's memory goes when the last op using it lets go of it."""

    def __init__(
        self, copy: Callable[[QuantWeight], T], size: Callable[[T], int], budget: int | None
    ) -> None:
        self._copy, self._size = copy, size
        self.stats = DeviceTierStats(budget=budget)
        self._held: OrderedDict[int, tuple[T, int, bool]] = OrderedDict()
        self._watched: set[int] = set()  # weights whose death drops their copy
        self._lock = threading.RLock()  # a finalizer may run inside get, on any thread

    def get(self, w: QuantWeight, expert: bool = False) -> T:
        """``w``'s copy (made now if it is not held); ``expert``: it is one of an expert's
        weights, counted apart in the stats."""
        with self._lock:
            return self._get(w, expert)

    def _get(self, w: QuantWeight, expert: bool) -> T:
        key = id(w)
        entry = self._held.get(key)
        if entry is not None:
            self._held.move_to_end(key)
            self.stats.hits += 1
            return entry[0]
        budget = self.stats.budget
        while budget is not None and self._held and self.stats.bytes + w.nbytes > budget:
            self._evict(next(iter(self._held)))  # make room first: no peak over the budget
        held = self.with_room(lambda: self._copy(w), f"a {w.nbytes / 2**20:.1f} MiB weight")
        size = self._size(held)
        if key not in self._watched:
            self._watched.add(key)
            weakref.finalize(w, self._forget, key)
        self._held[key] = (held, size, expert)
        self._count(size, expert, 1)
        self.stats.copies += 1
        self.stats.copied_bytes += size
        return held

    def with_room(self, allocate: Callable[[], A], what: str) -> A:
        """``allocate()``; when the device is fuller than the budget assumed (another
        program's memory), again once with the tier emptied; then one clear error."""
        try:
            return allocate()
        except Exception:  # noqa: BLE001 - pycuda's and the emulation's errors differ
            with self._lock:
                while self._held:
                    self._evict(next(iter(self._held)))
            gc.collect()  # copies only cycles still hold go now
            try:
                return allocate()
            except Exception as exc:  # noqa: BLE001 - one line, as every backend error
                raise BackendError(
                    f"the device has no room for {what} even with the device tier emptied "
                    f"({first_line(exc)}); free device memory or use --backend cpu"
                ) from exc

    def _evict(self, key: int) -> None:
        entry = self._held.pop(key, None)
        if entry is not None:
            self._count(entry[1], entry[2], -1)

    def _count(self, size: int, expert: bool, sign: int) -> None:
        self.stats.weights += sign
        self.stats.bytes += sign * size
        if expert:
            self.stats.expert_weights += sign
            self.stats.expert_bytes += sign * size

    def _forget(self, key: int) -> None:
        """The weight is gone: so is its copy, and the id may now name another weight."""
        with self._lock:
            self._watched.discard(key)
            self._evict(key)
