"""Belady's optimal replacement (offline): evict the entry used farthest in the future.

Only possible on a recorded trace; `colibri bench policy` prints it as the limit the
online policies are measured against.
"""

from __future__ import annotations

from collections.abc import Sequence


def belady_hits(accesses: Sequence[Sequence[int]], capacity: int) -> tuple[int, int]:
    """Hits and lookups of the optimal policy on one layer's per-step unions (a miss may
    bypass the cache when it is reused later than everything cached). It may make room
    with any cached key, one the step has just hit included, which `simulate` and the
    store never do: a relaxation, so its hit count bounds every online policy's."""
    steps = [sorted(set(s)) for s in accesses]
    future: dict[int, list[int]] = {}
    for t in range(len(steps) - 1, -1, -1):
        for key in steps[t]:
            future.setdefault(key, []).append(t)  # descending; pop() gives the next use
    never = len(steps) + 1

    def next_use(key: int) -> int:
        return future[key][-1] if future[key] else never

    cached: set[int] = set()
    hits = lookups = 0
    for step in steps:
        for key in step:
            future[key].pop()
            lookups += 1
            hits += key in cached
        for key in step:
            if key in cached or capacity <= 0:
                continue
            if len(cached) >= capacity:
                victim = max(cached, key=next_use)
                if next_use(key) >= next_use(victim):
                    continue  # optimal: bypass a key reused later than everything cached
                cached.discard(victim)
            cached.add(key)
    return hits, lookups


def fewest_reads(accesses: Sequence[Sequence[int]], capacity: int) -> int:
    """A lower bound on the reads any cache of `capacity` entries needs for these steps,
    whatever it held before the first: Belady's misses from an empty cache, less the
    `capacity` keys a warm start could already hold (each saves at most one read)."""
    hits, lookups = belady_hits(accesses, capacity)
    return max(0, lookups - hits - max(0, capacity))
