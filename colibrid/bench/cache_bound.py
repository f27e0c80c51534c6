"""The limit a cache policy works against, as the probe is the drive's: the fewest expert
bytes any cache of the store's size could have read for the routing a run recorded.

Why offline and per run: only a recorded trace tells the future Belady's rule needs, and
the bound depends on the run's own routing (`bench batch` prints it per concurrency,
`bench stream` per decode). A row reading far more than its bound has room for a better
policy or fewer wrong guesses; one reading about as much is at the cache's limit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from colibrid.bench.policy import per_layer
from colibrid.policy.belady import fewest_reads

if TYPE_CHECKING:
    from colibrid.store.tiered import TieredStore


def fewest_read_bytes(store: TieredStore, trace: list) -> int:
    """The fewest expert bytes any cache of the store's size could have read for the
    passes of `trace` (`take_pass` per pass; Belady per layer from the best starting
    content, the pinned experts free). The size is the largest the cache may reach in the
    run: with `--pilot auto`, PILOT's slots lent. With experts of several sizes (a precision
    plan) it stays a floor, counted loosely: as many experts as the smallest fit in the
    cache's bytes, each read at the smallest read's size."""
    plan = store.plan
    capacity = plan.cache_per_layer
    if store.pilot_switch is not None:
        capacity += plan.pilot // max(1, store.n_layers)
    capacity = store.reader.sizes.most_per_layer(capacity, store.layout.n_experts)
    pinned: dict[int, set[int]] = {}
    for layer, expert in store.pinned_keys():
        pinned.setdefault(layer, set()).add(expert)
    total = 0
    for layer, steps in per_layer(trace, with_prefill=True).items():
        free = pinned.get(layer, set())
        reads = fewest_reads([[e for e in s if e not in free] for s in steps], capacity)
        total += reads * min(x.read_bytes for x in store.extents[layer])
    return total
