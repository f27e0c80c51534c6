"""Preallocated, pre-faulted, aligned expert slabs in one anonymous mapping.

Why one arena: every expert read lands in a fixed-size slot, so the hot path allocates
nothing; an anonymous mmap is page-aligned (O_DIRECT needs an aligned buffer) and its
pages can be handed back to the kernel slot by slot (``MADV_DONTNEED``) when MEMWATCH
shrinks the cache, then faulted in again when it grows back — without unmapping memory
that numpy views still reference. Pages are faulted in once at start-up because RAM the
VM never touched fills slowly the first time (docs/performance.md).

Where Linux has ``MADV_POPULATE_WRITE`` (5.14+), the kernel faults a slot's pages in
writable in one call without touching their contents. That makes the start-up fault-in
safe to run beside the reads that fill the slots, so a load no longer waits for it: the
daemon answers while a background thread commits the cache's pages (a GLM-5-shaped
model's 1.5 GiB cache took 4.9 of a 12 s load in this VM, where first-touched memory comes
at ~0.5 GB/s). Elsewhere (macOS, older kernels) the pages are touched, before the load
returns, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from colibrid.store.extents import ALIGN, align_up

PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # linux/mman.h


def _libc_call(name: str) -> Callable[[int, int, int], int] | None:
    """libc's ``name(void *addr, size_t len, int arg)`` (madvise, mprotect) through ctypes,
    which drops the GIL for the call (the mmap module's own madvise holds it, so a
    background populate would stall the engine); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_call("madvise")
_MPROTECT = _libc_call("mprotect")
PROT_NONE = 0


class SlabArena:
    """``n_slots`` slots of ``slot_bytes`` (rounded up to ALIGN) each."""

    def __init__(self, slot_bytes: int, n_slots: int, *, prefault: bool = True) -> None:
        if n_slots < 1 or slot_bytes < 1:
            raise ValueError(f"need at least one slot of >= 1 byte, got {n_slots} x {slot_bytes}")
        self.slot_bytes = align_up(slot_bytes, max(ALIGN, PAGE))
        self.n_slots = n_slots
        self._populate_ok = True
        self._closing = threading.Event()
        self._prefault: threading.Thread | None = None
        # Private, not the default shared mapping: MADV_DONTNEED frees private pages only.
        # A guard page (no access) on each side keeps the slots one mapping of their own:
        # the kernel merges adjacent anonymous mappings of equal flags (another arena,
        # an allocator's), and MEMWATCH reads residency per mapping from smaps, so a
        # merged neighbour's pages would count as the slots' (mapping_rss).
        guard = PAGE if _MPROTECT is not None else 0
        size = self.slot_bytes * n_slots + 2 * guard
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        self._mm = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
        self._offset = guard  # slot 0's offset in the mapping
        if guard:
            base = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
            for at in (base, base + size - guard):
                if _MPROTECT(at, guard, PROT_NONE) != 0:
                    raise OSError(ctypes.get_errno(), "mprotect of the slab arena's guard")
        hugepage = getattr(mmap, "MADV_HUGEPAGE", None)
        if hugepage is not None and hasattr(self._mm, "madvise"):
            # Transparent huge pages: one 2 MiB page instead of 512 small ones per read
            # chunk, so direct I/O pins far fewer pages and kernels miss the TLB less.
            try:
                self._mm.madvise(hugepage)
            except OSError:
                pass  # THP disabled: small pages work the same, only slower
        self.buf = np.frombuffer(self._mm, dtype=np.uint8, count=self.nbytes, offset=guard)
        self._mv = memoryview(self._mm)[guard : guard + self.nbytes]
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

    def populate(self, i: int) -> bool:
        """Fault slot ``i``'s pages in, writable, contents untouched (MADV_POPULATE_WRITE);
        False where the kernel cannot (then nothing happened)."""
        if _MADVISE is None or not self._populate_ok:
            return False
        addr = self.buf.ctypes.data + i * self.slot_bytes
        if _MADVISE(addr, self.slot_bytes, MADV_POPULATE_WRITE) == 0:
            return True
        self._populate_ok = False  # EINVAL: a kernel before 5.14
        return False

    def fault_in(self, i: int) -> None:
        if not self.populate(i):
            self._slots[i][::PAGE] = 0

    def fault_in_background(
        self, slots: Sequence[int], skip: Callable[[int], bool]
    ) -> threading.Thread | None:
        """Fault ``slots`` in, in order, on a background thread, passing over any slot
        ``skip`` names when its turn comes (one parked meanwhile must stay without pages);
        the thread, or None when the kernel cannot populate without writing (then they
        were faulted in here, before returning)."""
        slots = list(slots)
        if not slots:
            return None
        if not self.populate(slots[0]):
            self.fault_in_many(slots)
            return None

        def run() -> None:
            for i in slots[1:]:
                if self._closing.is_set():
                    return
                if not skip(i):
                    self.populate(i)

        thread = threading.Thread(target=run, name="colibri-prefault", daemon=True)
        self._prefault = thread
        thread.start()
        return thread

    def wait_background(self) -> None:
        """Wait for a background fault-in to finish (callers that measure what is
        faulted, such as MEMWATCH's tests, must not race it)."""
        if self._prefault is not None:
            self._prefault.join()

    def stop_background(self) -> None:
        """Stop a background fault-in (between two slots) and wait for it."""
        self._closing.set()
        self.wait_background()

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

    def trim(self, i: int, keep: int) -> None:
        """Give back the pages of slot ``i`` past its first ``keep`` bytes (a smaller
        expert held in a tier: :mod:`colibrid.store.slot_sizes`); a later read faults
        them in again."""
        keep = align_up(keep, PAGE)
        if keep < self.slot_bytes:
            self._dontneed(i * self.slot_bytes + keep, self.slot_bytes - keep)

    def release(self, i: int) -> None:
        """Give slot ``i``'s pages back to the kernel (its contents become zeros)."""
        self._dontneed(i * self.slot_bytes, self.slot_bytes)

    def _dontneed(self, start: int, length: int) -> None:
        """MADV_DONTNEED on [start, start + length) of the slots (past the front guard)."""
        madvise = getattr(self._mm, "madvise", None)
        dontneed = getattr(mmap, "MADV_DONTNEED", None)
        if madvise is not None and dontneed is not None:
            madvise(dontneed, self._offset + start, length)
