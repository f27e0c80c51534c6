"""Preallocated, pre-faulted, aligned expert slabs in one anonymous mapping.

Why one arena: every expert read lands in a fixed-size slot, so the hot path allocates
nothing; an anonymous mmap is page-aligned (O_DIRECT needs an aligned buffer) and its
pages can be handed back to the kernel slot by slot (``MADV_DONTNEED``) when MEMWATCH
shrinks the cache, then faulted in again when it grows back — without unmapping memory
that numpy views still reference. Pages are touched once at start-up because RAM the VM
never touched fills slowly the first time (docs/performance.md).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from colibrid.store.extents import ALIGN, align_up

PAGE = mmap.PAGESIZE


class SlabArena:
    """``n_slots`` slots of ``slot_bytes`` (rounded up to ALIGN) each."""

    def __init__(self, slot_bytes: int, n_slots: int, *, prefault: bool = True) -> None:
        if n_slots < 1 or slot_bytes < 1:
            raise ValueError(f"need at least one slot of >= 1 byte, got {n_slots} x {slot_bytes}")
        self.slot_bytes = align_up(slot_bytes, max(ALIGN, PAGE))
        self.n_slots = n_slots
        # Private, not the default shared mapping: MADV_DONTNEED frees private pages only.
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        self._mm = (
            mmap.mmap(-1, self.slot_bytes * n_slots, flags=flags)
            if flags
            else mmap.mmap(-1, self.slot_bytes * n_slots)
        )
        hugepage = getattr(mmap, "MADV_HUGEPAGE", None)
        if hugepage is not None and hasattr(self._mm, "madvise"):
            # Transparent huge pages: one 2 MiB page instead of 512 small ones per read
            # chunk, so direct I/O pins far fewer pages and kernels miss the TLB less.
            try:
                self._mm.madvise(hugepage)
            except OSError:
                pass  # THP disabled: small pages work the same, only slower
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)
        self._mv = memoryview(self._mm)
        self._slots = [
            self.buf[i * self.slot_bytes : (i + 1) * self.slot_bytes] for i in range(n_slots)
        ]
        self._views = [
            self._mv[i * self.slot_bytes : (i + 1) * self.slot_bytes] for i in range(n_slots)
        ]
        if prefault:
            self.fault_in_many(range(n_slots))

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.n_slots

    def slot(self, i: int) -> np.ndarray:
        """The uint8 array of slot ``i`` (a preallocated view)."""
        return self._slots[i]

    def memview(self, i: int) -> memoryview:
        """Slot ``i`` as a writable memoryview (what ``os.preadv`` fills)."""
        return self._views[i]

    def fault_in(self, i: int) -> None:
        self._slots[i][::PAGE] = 0

    def fault_in_many(self, slots: Sequence[int], threads: int | None = None) -> None:
        """Fault many slots in on several threads (numpy drops the GIL while it writes).

        Why threads: a load pre-faults gigabytes, and a VM's first touch of memory it was
        never given runs at well under 1 GB/s per thread (3.4 s of a 4.7 s load of a
        10 GB GLM-5-shaped model at a 3.5 GB budget was this loop); page faults on
        different threads proceed in parallel."""
        slots = list(slots)
        n = max(1, min(threads or os.cpu_count() or 1, 8, len(slots)))
        if n == 1:
            for i in slots:
                self.fault_in(i)
            return
        with ThreadPoolExecutor(n, thread_name_prefix="colibri-fault") as pool:
            list(pool.map(self.fault_in, slots))

    def release(self, i: int) -> None:
        """Give slot ``i``'s pages back to the kernel (its contents become zeros)."""
        madvise = getattr(self._mm, "madvise", None)
        dontneed = getattr(mmap, "MADV_DONTNEED", None)
        if madvise is not None and dontneed is not None:
            madvise(dontneed, i * self.slot_bytes, self.slot_bytes)
