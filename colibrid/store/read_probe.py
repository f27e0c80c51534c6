"""The disk's speed for this model's expert reads, measured in the run that needs it.

Why here: every figure of a streamed decode is printed beside the limit of the same run
(DESIGN §8), and that limit is the drive's GB/s for *these* experts' aligned extents
through the store's own reader; `colibri bench stream` and `colibri eval --stream-ram-gb`
both divide by it.
"""

from __future__ import annotations

import time

import numpy as np

from colibrid.store.io_pool import IOPool
from colibrid.store.slabs import SlabArena
from colibrid.store.tiered import TieredStore


def probe(store: TieredStore, n_reads: int, threads: int, seed: int = 0) -> tuple[float, int]:
    """GB/s of direct reads of random experts (expert-sized, aligned, queue = threads)."""
    rng = np.random.default_rng(seed)
    layers = list(store.extents)
    keys = [
        (layers[rng.integers(len(layers))], int(rng.integers(store.layout.n_experts)))
        for _ in range(n_reads)
    ]
    slots = max(1, threads)
    arena = SlabArena(store.slot_bytes, slots)
    pool = IOPool(store.files, threads)
    try:
        t0 = time.perf_counter()
        total, inflight, free = 0, 0, list(range(slots))
        for la, e in keys:
            if not free:
                tag, n, err = pool.done.get()
                if err:
                    raise err
                total += n
                inflight -= 1
                free.append(tag)
            slot = free.pop()
            pool.submit(slot, store.extents[la][e].reads, arena.memview(slot))
            inflight += 1
        while inflight:
            tag, n, err = pool.done.get()
            if err:
                raise err
            total += n
            inflight -= 1
        return total / (time.perf_counter() - t0) / 1e9, total
    finally:
        pool.close()
