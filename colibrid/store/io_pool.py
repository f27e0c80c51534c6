"""Expert reads: direct I/O file handles and a persistent pool of reader threads.

Why threads: ``os.preadv`` releases the GIL, so several reads keep the drive's queue
busy while the engine thread computes the experts that are already resident. Workers
only fill slabs and report the slot number on a completion queue; every cache decision
stays on the engine thread, so there is nothing to lock around the cache.

Direct I/O: O_DIRECT on Linux (offset, length and buffer are ALIGN-aligned: the planner
reads the aligned superset), F_NOCACHE on macOS. Filesystems that refuse it (tmpfs,
some overlays: EINVAL) fall back to buffered reads and the reason is kept in
``ReadFiles.mode`` so callers can report it.
"""

from __future__ import annotations

import heapq
import logging
import mmap
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from colibrid.errors import CheckpointError
from colibrid.store.extents import ALIGN, Read

log = logging.getLogger("colibri.store")

STOP_CHUNK = 4 << 20
"""A background read runs in pieces this large and looks between them whether it was
asked to stop: small enough that a wrong guess stops within milliseconds of its layer
choosing other experts, large enough that the pieces' own cost is lost in the drive's."""


class ReadStopped(Exception):
    """A background read was stopped (:meth:`IOPool.stop`): its bytes are not valid.
    ``unread``: the bytes it was planned to read and did not."""

    def __init__(self, unread: int) -> None:
        super().__init__(f"read stopped with {unread} bytes unread")
        self.unread = unread


Check = Callable[[memoryview], None]
"""Run by the reader thread on the filled target before the read is reported complete;
what it raises is the read's error (a digest check: :mod:`colibrid.store.weight_checks`)."""


def _probe_direct(fd: int, size: int) -> str | None:
    """None when an aligned O_DIRECT read works on ``fd``, else the reason it does not."""
    buf = mmap.mmap(-1, ALIGN)
    try:
        os.preadv(fd, [buf], 0) if size else None
        return None
    except OSError as exc:
        return f"{exc.strerror or exc} ({os.strerror(exc.errno) if exc.errno else ''})".strip()
    finally:
        buf.close()


class ReadFiles:
    """One read-only descriptor per weight file, opened direct when asked and possible."""

    def __init__(self, paths: Sequence[Path], *, direct: bool) -> None:
        self.paths = list(paths)
        self.fds: list[int] = []
        self.sizes: list[int] = []
        self.mode = "buffered"
        reasons: list[str] = []
        for path in self.paths:
            fd, why = self._open(path, direct)
            self.fds.append(fd)
            self.sizes.append(os.fstat(fd).st_size)
            if why:
                reasons.append(f"{path.name}: {why}")
        if direct and not reasons:
            self.mode = "O_DIRECT" if sys.platform.startswith("linux") else "F_NOCACHE"
        elif direct:
            self.mode = "buffered (direct I/O unsupported: " + "; ".join(reasons[:2]) + ")"
            log.warning(
                "colibri: direct I/O not available, using buffered reads: %s",
                "; ".join(reasons[:2]),
            )

    @staticmethod
    def _open(path: Path, direct: bool) -> tuple[int, str | None]:
        try:
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                except OSError as exc:
                    why = f"open O_DIRECT: {exc.strerror}"
                else:
                    why = _probe_direct(fd, os.fstat(fd).st_size)
                    if why is None:
                        return fd, None
                    os.close(fd)
                return os.open(path, os.O_RDONLY), why
            fd = os.open(path, os.O_RDONLY)
            if direct:
                nocache = getattr(__import__("fcntl"), "F_NOCACHE", None)
                if nocache is None:
                    return fd, "no O_DIRECT or F_NOCACHE on this platform"
                __import__("fcntl").fcntl(fd, nocache, 1)
            return fd, None
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot open for reading ({exc.strerror})") from None

    @property
    def direct(self) -> bool:
        return self.mode in ("O_DIRECT", "F_NOCACHE")

    def read_into(
        self,
        reads: Sequence[Read],
        target: memoryview,
        stop: Callable[[], bool] | None = None,
    ) -> int:
        """Run ``reads`` into ``target``; returns bytes read. Short reads are retried;
        the aligned tail past end-of-file is allowed to come back short. Given ``stop``,
        each read runs in STOP_CHUNK pieces and :class:`ReadStopped` is raised between
        two once ``stop()`` is true."""
        total = 0
        for r in reads:
            fd, size = self.fds[r.file], self.sizes[r.file]
            want = min(r.length, size - r.offset)
            done = 0
            while done < want:
                if stop is not None and stop():
                    raise ReadStopped(sum(x.length for x in reads) - total - done)
                end = r.length if stop is None else min(r.length, done + STOP_CHUNK)
                n = os.preadv(
                    fd, [target[r.slab_offset + done : r.slab_offset + end]], r.offset + done
                )
                if n <= 0:
                    raise CheckpointError(
                        f"{self.paths[r.file]}: short read at {r.offset + done} "
                        f"({done}/{want} bytes)"
                    )
                done += n
            total += done
        return total

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


DEMAND_READ = 0  # a layer is waiting for this read
BACKGROUND = 1  # PILOT prefetch or REPIN promotion: only when no demand read waits


class IOPool:
    """Persistent reader threads. ``submit(tag, reads, target, priority)``; results come
    back on ``done`` as ``(tag, nbytes, error_or_None)`` in completion order.

    Why priorities: a layer's demand misses must not queue behind PILOT's guesses for the
    next layer, nor share the drive with them; background reads run only while no demand
    read is queued or running (a guess fills the drive's idle time: the attention and the
    last expert of a layer, before the next layer's misses are known), and one that has
    not started yet can be withdrawn (:meth:`cancel`) or promoted (:meth:`promote`) once
    the router has spoken. At most ``max_background`` background reads run at once, so the
    later, less confident guesses stay queued long enough to be withdrawn instead of
    costing disk time; one already running can be stopped (:meth:`stop`): it reads in
    pieces and gives the drive back at the next one, so a wrong guess costs the demand
    reads of its layer a few milliseconds, not the rest of an expert.

    Two, not one: an expert-sized read keeps the drive's queue deep while it runs, but when
    it ends its reader thread must get a core to start the next, and during decode the
    kernels hold the cores. With two in flight the drive stays busy through that gap: on the
    synthetic GLM-5 at 3x the budget (`colibri bench stream --model synth-glm5-64 --ram-gb
    3.5 --pilot on`) the drive read at 96-102% of the O_DIRECT probe instead of 80-94%, and
    decode was 2-7% faster in each of three interleaved pairs though 5-6% more bytes were
    read (more guesses); on the demo at `--cache 2` 5-17% faster. Three were slower than two
    on GLM-5 in both pairs tried.
    Each tag has at most one read in the pool at a time.

    Given ``unit_bytes`` (the largest read: a whole expert), the limit counts bytes, not
    reads: background reads start while those running hold less than ``max_background``
    units, so a mixed-precision container's small cold experts keep as many bytes in
    flight as two whole experts do (three 2-bit experts where two 4-bit ones would run),
    and the gap each read's end leaves costs the same share of the drive's time whatever
    the reads' sizes. A uniform container's reads are all one unit: the same two.

    With ``threads == 0`` the read runs inline in ``submit`` and its result is queued
    the same way, so callers have one code path and the output cannot depend on it.

    A read may carry a ``check`` the reader thread runs on the bytes it read before it
    reports the completion, so hashing them overlaps the engine's compute like the read
    does, and a failed check reports the read as failed: its slot is never used. The
    drive is free once the bytes are in: the read stops counting as running (for the
    background rule and the busy time) before its check starts, so the next read, a
    guess included, starts while this one is hashed.
    """

    def __init__(
        self, files: ReadFiles, threads: int, max_background: int = 2, unit_bytes: int = 0
    ) -> None:
        self.files = files
        self.threads = max(0, int(threads))
        self.max_background = max(1, int(max_background))
        # what a read costs against the background limit: its bytes given a unit, else 1
        self._unit_bytes = max(0, int(unit_bytes))
        self._background_limit = self.max_background * (self._unit_bytes or 1)
        self._background_tags: set[int] = set()  # background reads a worker is doing now
        self._stop_asked: set[int] = set()  # those of them asked to stop
        self._background_in_flight = 0  # their costs
        self._running = 0  # reads a worker is doing now
        self._busy_since = 0.0
        self._busy_s = 0.0  # wall time with at least one read running
        self.done: queue.SimpleQueue[tuple[int, int, BaseException | None]] = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._heap: list[tuple[int, int, int]] = []  # (priority, seq, tag)
        self._queued: dict[int, tuple[int, int, Sequence[Read], memoryview, Check | None]] = {}
        self._seq = 0
        self._closing = False
        self._workers = [
            threading.Thread(target=self._work, name=f"colibri-io-{i}", daemon=True)
            for i in range(self.threads)
        ]
        for t in self._workers:
            t.start()

    def _read(
        self, reads: Sequence[Read], target: memoryview, stop: Callable[[], bool] | None = None
    ) -> tuple[int, BaseException | None]:
        try:
            return self.files.read_into(reads, target, stop), None
        except BaseException as exc:  # reported to the waiter, never lost in a thread
            return 0, exc

    def _report(
        self, tag: int, n: int, err: BaseException | None, target: memoryview, check: Check | None
    ) -> None:
        """Check what was read (when it was read whole) and queue the completion."""
        if err is None and check is not None:
            try:
                check(target)
            except BaseException as exc:
                n, err = 0, exc
        self.done.put((tag, n, err))

    def _next(self) -> tuple[int, Sequence[Read], memoryview, Check | None, int | None] | None:
        """The next read a worker may start: (tag, reads, target, check, its background
        cost or None for a demand read); None once the pool closes."""
        with self._cv:
            while True:
                while self._heap:
                    prio, seq, tag = self._heap[0]
                    job = self._queued.get(tag)
                    if job is None or job[1] != seq:  # cancelled or re-queued: drop it
                        heapq.heappop(self._heap)
                        continue
                    cost = self._cost(job[2]) if prio == BACKGROUND else None
                    if cost is not None and (
                        self._background_full(cost) or self._running > len(self._background_tags)
                    ):
                        break  # only background work left: it waits for an idle drive
                    heapq.heappop(self._heap)
                    del self._queued[tag]
                    if cost is not None:
                        self._background_in_flight += cost
                        self._background_tags.add(tag)
                    if self._running == 0:
                        self._busy_since = time.perf_counter()
                    self._running += 1
                    return tag, job[2], job[3], job[4], cost
                if self._closing:
                    return None
                self._cv.wait()

    def _cost(self, reads: Sequence[Read]) -> int:
        return sum(r.length for r in reads) if self._unit_bytes else 1

    def _background_full(self, cost: int) -> bool:
        """Whether a background read of ``cost`` must wait for one running to end (one
        always may run: a read larger than the limit is not starved)."""
        return (
            bool(self._background_tags)
            and self._background_in_flight + cost > self._background_limit
        )

    def _work(self) -> None:
        while (job := self._next()) is not None:
            tag, reads, target, check, cost = job
            stop = None if cost is None else (lambda tag=tag: tag in self._stop_asked)
            n, err = self._read(reads, target, stop)
            with self._cv:
                if cost is not None:
                    self._background_tags.discard(tag)
                    self._background_in_flight -= cost
                    if tag in self._stop_asked:  # asked too late to save a byte: still
                        self._stop_asked.discard(tag)  # reported stopped, as promised
                        if err is None:
                            n, err = 0, ReadStopped(0)
                self._running -= 1
                if self._running == 0:
                    self._busy_s += time.perf_counter() - self._busy_since
                if self._running == len(self._background_tags):
                    self._cv.notify_all()  # background work may start on an idle drive
            self._report(tag, n, err, target, check)

    def submit(
        self,
        tag: int,
        reads: Sequence[Read],
        target: memoryview,
        priority: int = DEMAND_READ,
        check: Check | None = None,
    ) -> None:
        if not self.threads:
            t0 = time.perf_counter()
            n, err = self._read(reads, target)
            self._busy_s += time.perf_counter() - t0
            self._report(tag, n, err, target, check)
            return
        with self._cv:
            self._enqueue(tag, priority, reads, target, check)

    def _enqueue(
        self,
        tag: int,
        priority: int,
        reads: Sequence[Read],
        target: memoryview,
        check: Check | None,
    ) -> None:
        """Queue (or re-queue: the older heap entry goes stale) a read; holds the lock."""
        self._seq += 1
        self._queued[tag] = (priority, self._seq, reads, target, check)
        heapq.heappush(self._heap, (priority, self._seq, tag))
        self._cv.notify()

    def busy_seconds(self) -> float:
        """Total wall time during which at least one read was running: what achieved
        GB/s divides by (demand and background reads alike)."""
        with self._cv:
            extra = time.perf_counter() - self._busy_since if self._running else 0.0
            return self._busy_s + extra

    def cancel(self, tag: int) -> bool:
        """Withdraw a read no worker has started; True when its completion will never come."""
        with self._cv:
            return self._queued.pop(tag, None) is not None

    def stop(self, tag: int) -> bool:
        """Ask a background read a worker is doing to stop at its next piece; True when
        it was running: its completion then always reports :class:`ReadStopped`."""
        with self._cv:
            if tag not in self._background_tags:
                return False
            self._stop_asked.add(tag)
            return True

    def promote(self, tag: int) -> None:
        """Make a queued background read a demand read (the layer now waits for it);
        no-op once a worker has taken it."""
        with self._cv:
            job = self._queued.get(tag)
            if job is not None and job[0] != DEMAND_READ:
                self._enqueue(tag, DEMAND_READ, job[2], job[3], job[4])

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._queued.clear()
            self._heap.clear()
            self._cv.notify_all()
        for t in self._workers:
            t.join(timeout=5)
        self._workers = []
