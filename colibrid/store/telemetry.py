"""Store telemetry: counters the store bumps on its hot path and the frozen snapshot
``statistics()`` hands out (per request and cumulative).

Why split by tier: the hit rate alone hides *why* a token was fast; pinned hits cost
nothing to keep, cache hits cost RAM, prefetched hits are PILOT's work and misses are
disk time. Bytes read per token and achieved GB/s are what the roofline compares.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields


@dataclass
class Counters:
    hits_pinned: int = 0
    hits_cache: int = 0
    hits_prefetched: int = 0
    misses: int = 0
    bytes_read: int = 0  # demand + prefetch bytes from disk (aligned supersets)
    prefetch_bytes: int = 0
    needed_bytes: int = 0  # read bytes of the experts a layer chose that were not resident
    io_active_s: float = 0.0  # wall time with at least one read running (the pool's clock)
    io_wait_s: float = 0.0  # engine thread blocked on a read
    compute_s: float = 0.0  # engine thread inside expert compute (between yields)
    attention_s: float = 0.0  # engine thread inside attention (the model's clock)
    tokens: int = 0
    token_wall_s: float = 0.0
    pilot_predicted: int = 0  # predicted (layer, expert) keys
    pilot_correct: int = 0  # predicted keys the layer then chose
    pilot_chosen: int = 0  # keys chosen in layers that had a prediction
    pilot_loads: int = 0  # prefetch reads issued
    pilot_cancelled: int = 0  # prefetch reads withdrawn before they started (wrong guesses)
    pilot_stopped: int = 0  # prefetch reads stopped part-way (wrong guesses already running)
    checked: int = 0  # expert reads held to their digests (reader threads, under a lock)
    check_s: float = 0.0  # reader-thread time those checks took

    def copy(self) -> Counters:
        return Counters(**{f.name: getattr(self, f.name) for f in fields(self)})

    def minus(self, other: Counters) -> Counters:
        return Counters(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)}
        )


@dataclass(frozen=True)
class StoreStats:
    """A snapshot: hit rates by tier, I/O volume and speed, time split, PILOT, cache size."""

    lookups: int
    hits_pinned: int
    hits_cache: int
    hits_prefetched: int
    misses: int
    bytes_read: int
    bytes_per_token: float
    read_gb_s: float
    io_wait_s: float
    compute_s: float
    attention_s: float
    other_s: float
    tokens: int
    pilot_recall: float | None
    pilot_loads: int
    pilot_cancelled: int
    cache_per_layer: int
    cache_bytes: int
    pinned: int
    io_mode: str
    policy: str
    memwatch: str
    # What `colibri ps` shows of placement (filled by each store's statistics()).
    resident_experts: int = 0  # experts in RAM now (pinned + cached, or all when resident)
    expert_bytes: int = 0  # one expert as stored (a slot for the tiered store)
    total_experts: int = 0  # routed experts of every served layer
    pin_capacity: int = 0  # slots the plan reserved for pins
    pin_mode: str = "off"
    pin_note: str = "off"  # what the pin controller did, in words
    streams: bool = False  # experts are read from disk (the cache cannot hold them all)
    pilot_note: str = "off"  # PILOT: off, on, or what --pilot auto measured and chose
    checked: int = 0  # expert reads checked against their digests
    check_s: float = 0.0
    needed_bytes: int = 0  # read bytes of the chosen experts that were not resident
    pilot_stopped: int = 0  # prefetch reads stopped part-way (their layer chose others)

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.misses / self.lookups if self.lookups else 0.0

    def lines(self, title: str = "store") -> list[str]:
        n = max(self.lookups, 1)
        pct = lambda x: f"{100.0 * x / n:.1f}%"  # noqa: E731
        recall = "off" if self.pilot_recall is None else f"{100 * self.pilot_recall:.1f}%"
        checks = ""
        if self.checked:
            checks = (
                f"; {self.checked} experts checked against their digests "
                f"({self.check_s:.3f} s in reader threads)"
            )
        return [
            f"{title}: hit {100 * self.hit_rate:.1f}% of {self.lookups} lookups (pinned "
            f"{pct(self.hits_pinned)}, cache {pct(self.hits_cache)}, prefetched "
            f"{pct(self.hits_prefetched)}, miss {pct(self.misses)})",
            f"{title}: read {self.bytes_read / 1e9:.3f} GB, {self.bytes_per_token / 1e6:.1f} MB/"
            f"token, {self.read_gb_s:.2f} GB/s achieved ({self.io_mode}){checks}",
            f"{title}: time io-wait {self.io_wait_s:.3f} s, expert compute {self.compute_s:.3f} "
            f"s, attention {self.attention_s:.3f} s, other (shared experts, dense MLPs, "
            f"routing) {self.other_s:.3f} s over {self.tokens} forward passes",
            f"{title}: PILOT {self.pilot_note}; recall {recall}, {self.pilot_loads} prefetch "
            f"loads ({self.pilot_cancelled} withdrawn unread, {self.pilot_stopped} stopped "
            f"part-way); cache "
            f"{self.cache_per_layer} experts/layer ({self.cache_bytes / 2**30:.2f} GiB, "
            f"{self.policy}), {self.pinned} pinned; memwatch: {self.memwatch}",
        ]


def snapshot(
    c: Counters,
    *,
    cache_per_layer: int,
    cache_bytes: int,
    pinned: int,
    io_mode: str,
    policy: str,
    memwatch: str,
) -> StoreStats:
    lookups = c.hits_pinned + c.hits_cache + c.hits_prefetched + c.misses
    return StoreStats(
        lookups=lookups,
        hits_pinned=c.hits_pinned,
        hits_cache=c.hits_cache,
        hits_prefetched=c.hits_prefetched,
        misses=c.misses,
        bytes_read=c.bytes_read,
        bytes_per_token=c.bytes_read / c.tokens if c.tokens else 0.0,
        read_gb_s=c.bytes_read / c.io_active_s / 1e9 if c.io_active_s > 0 else 0.0,
        io_wait_s=c.io_wait_s,
        compute_s=c.compute_s,
        attention_s=c.attention_s,
        other_s=max(0.0, c.token_wall_s - c.io_wait_s - c.compute_s - c.attention_s),
        tokens=c.tokens,
        pilot_recall=c.pilot_correct / c.pilot_chosen if c.pilot_chosen else None,
        pilot_loads=c.pilot_loads,
        pilot_cancelled=c.pilot_cancelled,
        cache_per_layer=cache_per_layer,
        cache_bytes=cache_bytes,
        pinned=pinned,
        io_mode=io_mode,
        policy=policy,
        memwatch=memwatch,
        checked=c.checked,
        check_s=c.check_s,
        needed_bytes=c.needed_bytes,
        pilot_stopped=c.pilot_stopped,
    )


now = time.perf_counter
