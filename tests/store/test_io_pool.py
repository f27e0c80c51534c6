"""The reader pool's ordering contract: demand reads overtake background reads, a
background read nobody has started can be withdrawn or promoted, one running can be
stopped, and every submitted read that is not withdrawn completes exactly once."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.store.extents import ALIGN, Read
from colibrid.store.io_pool import (
    BACKGROUND,
    DEMAND_READ,
    STOP_CHUNK,
    IOPool,
    ReadFiles,
    ReadStopped,
)
from colibrid.store.slabs import SlabArena


def _data() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, 4 * ALIGN, dtype=np.uint8)


def _pool(tmp_path, threads: int, unit_bytes: int = 0) -> tuple[IOPool, SlabArena, list[Read]]:
    path = tmp_path / "blob.bin"
    path.write_bytes(_data().tobytes())
    files = ReadFiles([path], direct=True)
    arena = SlabArena(ALIGN, 8)
    reads = [Read(file=0, offset=k * ALIGN, length=ALIGN, slab_offset=0) for k in range(4)]
    return IOPool(files, threads, unit_bytes=unit_bytes), arena, reads


def _drain(pool: IOPool, n: int) -> list[int]:
    out = []
    for _ in range(n):
        tag, nbytes, err = pool.done.get(timeout=10)
        assert err is None and nbytes == ALIGN
        out.append(tag)
    return out


def test_demand_overtakes_background_and_withdrawn_never_completes(tmp_path) -> None:
    pool, arena, reads = _pool(tmp_path, threads=1)
    try:
        # Hold the pool's lock while queueing so the worker sees the whole queue at once
        # (the lock is re-entrant for this thread): the order is then deterministic.
        with pool._cv:
            pool.submit(0, [reads[0]], arena.memview(0), BACKGROUND)
            pool.submit(1, [reads[1]], arena.memview(1), BACKGROUND)
            pool.submit(2, [reads[2]], arena.memview(2), BACKGROUND)
            pool.submit(3, [reads[3]], arena.memview(3), DEMAND_READ)
            assert pool.cancel(1)
            pool.promote(2)
        assert _drain(pool, 3) == [3, 2, 0]
        assert pool.done.empty()
        assert not pool.cancel(0)  # already done: nothing to withdraw
        assert np.array_equal(arena.slot(3), _data()[3 * ALIGN :])
    finally:
        pool.close()
        pool.files.close()


def test_inline_pool_reads_at_submit(tmp_path) -> None:
    pool, arena, reads = _pool(tmp_path, threads=0)
    try:
        pool.submit(5, [reads[2]], arena.memview(5), BACKGROUND)
        assert not pool.cancel(5)
        assert _drain(pool, 1) == [5]
    finally:
        pool.close()
        pool.files.close()


def test_background_waits_for_an_idle_drive(tmp_path) -> None:
    """A guess must not share the drive with a read a layer is waiting for: a background
    read starts only once no demand read is running, even with a reader thread free."""
    import threading

    pool, arena, reads = _pool(tmp_path, threads=2)
    release = threading.Event()
    started: list[int] = []
    real = pool.files.read_into

    def slow_demand(batch, target, stop=None):  # noqa: ANN001, ANN202
        started.append(batch[0].offset // ALIGN)
        if batch[0].offset == 0:  # the demand read: the drive stays busy until released
            assert release.wait(timeout=10)
        return real(batch, target, stop)

    pool.files.read_into = slow_demand
    try:
        pool.submit(0, [reads[0]], arena.memview(0), DEMAND_READ)
        pool.submit(1, [reads[1]], arena.memview(1), BACKGROUND)
        assert not release.wait(timeout=0.3)  # give the free thread time to misbehave
        assert started == [0] and pool.done.empty()
        release.set()
        assert _drain(pool, 2) == [0, 1]
    finally:
        release.set()
        pool.close()
        pool.files.close()


def _started_at_once(tmp_path, unit_bytes: int) -> int:
    """How many of four one-ALIGN background reads run at once on four reader threads."""
    import threading

    tmp_path.mkdir()
    pool, arena, reads = _pool(tmp_path, threads=4, unit_bytes=unit_bytes)
    files = pool.files
    release = threading.Event()
    started: list[int] = []
    real = files.read_into

    def held(batch, target, stop=None):  # noqa: ANN001, ANN202
        started.append(batch[0].offset)
        assert release.wait(timeout=10)
        return real(batch, target, stop)

    files.read_into = held
    try:
        for k, read in enumerate(reads):
            pool.submit(k, [read], arena.memview(k), BACKGROUND)
        assert not release.wait(timeout=0.3)  # time for every read allowed to start
        running = len(started)
        release.set()
        assert sorted(_drain(pool, 4)) == [0, 1, 2, 3]  # the held-back ones run after
        return running
    finally:
        release.set()
        pool.close()
        files.close()


def test_background_depth_counts_bytes_when_given_a_unit(tmp_path) -> None:
    """Without a unit, two background reads at once whatever their size; with one (the
    largest read), as many as fit in two units' bytes, so small cold experts keep the
    same bytes in flight; and one always runs, even when larger than the limit."""
    assert _started_at_once(tmp_path / "a", 0) == 2
    assert _started_at_once(tmp_path / "b", 3 * ALIGN // 2) == 3  # 2 units = 3 reads
    assert _started_at_once(tmp_path / "c", 4 * ALIGN) == 4  # all fit, threads bound
    assert _started_at_once(tmp_path / "d", ALIGN // 4) == 1  # over the limit: one at a time


def test_a_read_being_checked_leaves_the_drive_to_the_next(tmp_path) -> None:
    """Once a demand read's bytes are in, its digest check no longer holds the drive: a
    guess queued behind it is read while the check runs, and the checked read is still
    reported only after its check passed."""
    import threading

    pool, arena, reads = _pool(tmp_path, threads=2)
    release = threading.Event()
    checking = threading.Event()

    def slow_check(view: memoryview) -> None:
        checking.set()
        assert release.wait(timeout=10)

    try:
        pool.submit(0, [reads[0]], arena.memview(0), DEMAND_READ, check=slow_check)
        assert checking.wait(timeout=10)
        pool.submit(1, [reads[1]], arena.memview(1), BACKGROUND)
        tag, nbytes, err = pool.done.get(timeout=10)  # the guess, during the check
        assert (tag, nbytes, err) == (1, ALIGN, None)
        assert pool.done.empty()  # the checked read waits for its check
        release.set()
        assert _drain(pool, 1) == [0]
    finally:
        release.set()
        pool.close()
        pool.files.close()


def test_a_read_asked_to_stop_stops_between_pieces(tmp_path) -> None:
    """Given ``stop``, a read runs in STOP_CHUNK pieces and gives up at the first piece
    boundary after ``stop()`` turns true, saying how much it left unread."""
    size = 2 * STOP_CHUNK + ALIGN
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "big.bin"
    path.write_bytes(data.tobytes())
    files = ReadFiles([path], direct=True)
    arena = SlabArena(size, 1)
    asked = iter([False, True])
    try:
        read = Read(file=0, offset=0, length=size, slab_offset=0)
        with pytest.raises(ReadStopped) as stopped:
            files.read_into([read], arena.memview(0), stop=lambda: next(asked))
        assert stopped.value.unread == size - STOP_CHUNK
        assert np.array_equal(arena.slot(0)[:STOP_CHUNK], data[:STOP_CHUNK])
        assert files.read_into([read], arena.memview(0), stop=lambda: False) == size
        assert np.array_equal(arena.slot(0), data)
    finally:
        files.close()


def test_a_running_background_read_asked_to_stop_reports_stopped(tmp_path) -> None:
    """Only a background read a worker is doing can be stopped; once stopped it always
    reports ReadStopped (never bytes the caller would trust), and the ask does not
    outlive it: the next read with the same tag runs whole."""
    import threading

    pool, arena, reads = _pool(tmp_path, threads=1)
    release, running = threading.Event(), threading.Event()
    real = pool.files.read_into

    def held(batch, target, stop=None):  # noqa: ANN001, ANN202
        running.set()
        assert release.wait(timeout=10)
        return real(batch, target, stop)

    pool.files.read_into = held
    try:
        assert not pool.stop(0)  # nothing with that tag
        pool.submit(0, [reads[0]], arena.memview(0), BACKGROUND)
        assert running.wait(timeout=10)
        assert pool.stop(0) and not pool.cancel(0)
        release.set()
        tag, nbytes, err = pool.done.get(timeout=10)
        assert tag == 0 and nbytes == 0 and isinstance(err, ReadStopped)
        pool.submit(0, [reads[1]], arena.memview(0), BACKGROUND)
        assert _drain(pool, 1) == [0]
        assert np.array_equal(arena.slot(0), _data()[ALIGN : 2 * ALIGN])
        pool.submit(1, [reads[2]], arena.memview(1), DEMAND_READ)
        assert _drain(pool, 1) == [1]
        assert not pool.stop(1)  # a demand read is never stopped (and this one is done)
    finally:
        release.set()
        pool.close()
        pool.files.close()
