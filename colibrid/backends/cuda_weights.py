"""colibri weights in device memory, and the VRAM tier that decides which stay there.

A weight goes to the device as the container stores it (codes and scales, docs/formats.md):
the kernels read every format directly, so the copy is the whole conversion.

The tier holds device copies up to a byte budget, least recently used out first; a weight
not on the device is copied in at its use. Which weights are on the device never changes
a result: every product runs the same kernel on the same bytes wherever they came from,
so placement stays token-invariant (docs/architecture.md). What is resident on the host
for good (the dense weights, pinned and cached experts) is used every token and stays
hot; a streamed expert comes in once per read from disk, over a bus faster than the
disk that brought it. A copy is dropped when its weight object goes (a streamed
expert's view dies with its slot's fill), so the tier never serves stale bytes.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from colibrid.backends.base import DeviceTierStats
from colibrid.backends.cuda_device import Buffer, Device
from colibrid.errors import BackendError, first_line
from colibrid.formats.weights import QuantWeight, WeightFormat

T = TypeVar("T")

FORMAT_CODES = {
    WeightFormat.F32: 0,
    WeightFormat.BF16: 1,
    WeightFormat.Q8: 2,
    WeightFormat.Q4: 3,
    WeightFormat.FP4: 4,
}
"""Each format's number in native/cuda/kernels.cu (FMT_*)."""


@dataclass(frozen=True, eq=False)
class DeviceWeight:
    """One weight [O, I] on the device: rows of ``row_bytes`` at ``data``, scales (if any)
    at ``scales``, ``groups`` of ``group`` inputs a row."""

    shape: tuple[int, int]
    fmt: int
    data: int
    scales: int
    row_bytes: int
    group: int
    groups: int
    scale_bytes: int  # one scale's size (4 for float, 1 for FP4's e8m0 byte, 0 for none)
    buffers: tuple[Buffer, ...] = field(default=(), repr=False)  # what keeps the memory

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def rows(self, lo: int, hi: int) -> DeviceWeight:
        """Rows [lo, hi) as a weight of their own, sharing the memory."""
        return DeviceWeight(
            (hi - lo, self.shape[1]),
            self.fmt,
            self.data + lo * self.row_bytes,
            self.scales + lo * self.groups * self.scale_bytes,
            self.row_bytes,
            self.group,
            self.groups,
            self.scale_bytes,
            self.buffers,
        )


def upload(device: Device, w: QuantWeight) -> DeviceWeight:
    """``w``'s bytes copied to the device, as stored."""
    o, i = w.shape
    data = np.ascontiguousarray(w.data)
    row_bytes = data.nbytes // o if o else 0
    data_buf = device.alloc(data.nbytes)
    device.upload(data_buf.ptr, data)
    buffers: tuple[Buffer, ...] = (data_buf,)
    scales_ptr, scale_bytes, group, groups = 0, 0, i, 1
    if w.scales is not None:
        scales = np.ascontiguousarray(w.scales)
        if w.fmt in (WeightFormat.Q4, WeightFormat.FP4) and 0 < w.group_size < i:
            group, groups = w.group_size, -(-i // w.group_size)
        scale_buf = device.alloc(scales.nbytes)
        device.upload(scale_buf.ptr, scales)
        buffers += (scale_buf,)
        scales_ptr, scale_bytes = scale_buf.ptr, scales.itemsize
    return DeviceWeight(
        (o, i), FORMAT_CODES[w.fmt], data_buf.ptr, scales_ptr, row_bytes, group, groups,
        scale_bytes, buffers,
    )  # fmt: skip


class VramTier:
    """Device copies of weights by weight object, least recently used out first once
    their bytes pass ``budget``. An evicted copy's memory goes when the last op using it
    lets go of it (a DeviceWeight keeps its buffers)."""

    def __init__(self, device: Device, budget: int) -> None:
        self.device = device
        self.stats = DeviceTierStats(budget=budget)
        self._held: OrderedDict[int, tuple[DeviceWeight, bool]] = OrderedDict()
        self._watched: set[int] = set()  # weights whose death drops their copy
        self._lock = threading.RLock()  # a finalizer may run inside get, on any thread

    def get(self, w: QuantWeight, expert: bool = False) -> DeviceWeight:
        """``w`` on the device (copied in now if it is not); ``expert``: it is one of an
        expert's weights, counted apart in the stats."""
        with self._lock:
            return self._get(w, expert)

    def _get(self, w: QuantWeight, expert: bool) -> DeviceWeight:
        key = id(w)
        entry = self._held.get(key)
        if entry is not None:
            self._held.move_to_end(key)
            self.stats.hits += 1
            return entry[0]
        while self._held and self.stats.bytes + w.nbytes > self.stats.budget:
            self._evict(next(iter(self._held)))  # make room first: no peak over the budget
        held = self.with_room(
            lambda: upload(self.device, w), f"a {w.nbytes / 2**20:.1f} MiB weight"
        )
        if key not in self._watched:
            self._watched.add(key)
            weakref.finalize(w, self._forget, key)
        self._held[key] = (held, expert)
        self._count(held, expert, 1)
        self.stats.copies += 1
        self.stats.copied_bytes += held.nbytes
        return held

    def with_room(self, allocate: Callable[[], T], what: str) -> T:
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
                    f"the GPU has no room for {what} even with the VRAM tier emptied "
                    f"({first_line(exc)}); free device memory or use --backend cpu"
                ) from exc

    def _evict(self, key: int) -> None:
        entry = self._held.pop(key, None)
        if entry is not None:
            self._count(*entry, -1)

    def _count(self, held: DeviceWeight, expert: bool, sign: int) -> None:
        self.stats.weights += sign
        self.stats.bytes += sign * held.nbytes
        if expert:
            self.stats.expert_weights += sign
            self.stats.expert_bytes += sign * held.nbytes

    def _forget(self, key: int) -> None:
        """The weight is gone: so is its copy, and the id may now name another weight."""
        with self._lock:
            self._watched.discard(key)
            self._evict(key)
