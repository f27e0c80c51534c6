"""Eviction and admission policies, one for every tier, and an offline simulator.

The same policies order the store's per-layer expert caches (RAM, keyed by expert index)
and a backend's device tier (VRAM or MLX memory, keyed by weight: backends/device_tier.py),
so a tier above RAM keeps experts by the rule the RAM cache keeps them by. A policy only
orders keys; its owner holds the memory. Every policy implements ``touch`` (a hit),
``seen`` (a lookup that missed), ``admit`` (a new entry), ``remove``, ``forget`` (the key's
object is gone: drop its history too), ``victim`` (the entry to evict, skipping
``protected`` keys: experts the current layer still needs) and ``admits`` (whether a
demand read may displace that victim, or is used once and dropped).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Protocol

from colibrid.policy.gated import GatedLFRU, HeatGatedLFRU
from colibrid.policy.lfru import LFRU
from colibrid.policy.lru import LRU


class Policy(Protocol):
    def touch(self, key: int) -> None: ...
    def seen(self, key: int) -> None: ...
    def admit(self, key: int) -> None: ...
    def remove(self, key: int) -> None: ...
    def forget(self, key: int) -> None: ...
    def victim(self, protected: Container[int] = ()) -> int | None: ...
    def admits(self, key: int, victim: int) -> bool: ...
    def __len__(self) -> int: ...


POLICIES: dict[str, Callable[[], Policy]] = {
    "lru": LRU,
    "lfru": LFRU,
    "gated-lfru": GatedLFRU,
    "heat-gated-lfru": HeatGatedLFRU,
}
DEFAULT_POLICY = "gated-lfru"
"""Chosen by `colibri bench policy` on REPLAY traces (decode hit rates). Four demo requests
of 64 tokens, 1 / 2 / 4 / 8 experts per layer of 16: LRU 19.7 / 36.4 / 65.9 / 90.1%, LFRU
19.7 / 37.8 / 67.5 / 90.9%, gated LFRU 22.8 / 42.4 / 67.5 / 90.6%, Belady 24.6 / 47.8 /
77.5 / 94.8%. Four requests of 128 tokens on a synthetic GLM-5 (8 layers, 64 experts, a
random router: no skew to learn), 2 / 8 / 32 experts per layer: LRU 4.0 / 15.7 / 57.8%,
LFRU 4.8 / 18.0 / 58.8%, gated 6.4 / 20.5 / 62.5%, Belady 17.3 / 42.3 / 81.3%. In the store
(`bench replay`, the demo trace, `--cache 2 --pilot off`): 61.8% -> 59.2% of lookups read,
57.7 -> 55.4 MB/token; with PILOT on the reads barely move (75.4 -> 74.9 MB/token).
Re-measure on real traces."""


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown cache policy {name!r} (choose from {', '.join(POLICIES)})"
        ) from None


def simulate(policy: Policy, accesses: Sequence[Sequence[int]], capacity: int) -> tuple[int, int]:
    """Replay one layer's per-step expert unions through ``policy`` with ``capacity``
    slots, the way the store serves a layer: every key looked up first (hits touch, misses
    are seen), then the misses in ascending order, each offered to the cache once used,
    over a victim that is neither a hit of this step nor a miss still to come (those stay
    protected), when the policy admits it. Returns (hits, lookups)."""
    cached: set[int] = set()
    hits = lookups = 0
    for step in accesses:
        need = set(step)
        for key in sorted(need):
            lookups += 1
            if key in cached:
                hits += 1
                policy.touch(key)
            else:
                policy.seen(key)
        if capacity <= 0:
            continue
        protected = set(need)
        for key in sorted(need - cached):
            protected.discard(key)
            while len(cached) >= capacity:
                v = policy.victim(protected)
                if v is None or not policy.admits(key, v):
                    break
                policy.remove(v)
                cached.discard(v)
            if len(cached) < capacity:
                policy.admit(key)
                cached.add(key)
    return hits, lookups
