"""The roofline, live, per request: the machine's ceilings owned by the daemon, and each
request's share of them.

Why live: a benchmark's ratio says how close colibri came on the run it measured; a user
serving real prompts wants to know how close *their* request came, and no serving engine
says so. The ceilings are measured by the daemon itself, on the loaded model's own files:

* disk: the O_DIRECT probe of ``colibri bench stream`` (random experts' real aligned
  extents through the store's reader; store/read_probe.py), GB/s — only where the store
  reads experts from disk;
* memory: the native read-bandwidth probe of ``colibri bench decode`` (its 512 MB
  buffer, allocated for the probe and freed after), GB/s;
* kernels: the CPU kernels' arithmetic for one token (serve.kernel_ceiling: each weight
  layout the model uses timed cache-hot at S = 1, priced over the matrices a token
  multiplies), tok/s — ``colibri bench decode``'s kernel floor, cheap enough to take
  beside the other probes (None on another backend);
* the weights a pass reads besides the routed experts (the dense part: attention, shared
  experts, dense MLPs, the head; the embedding table counts one row) and one expert's
  bytes, so the expert lookups counted per pass give the weight bytes a token touched.

They are measured once right after a load (before any request can run) and again only
when the daemon is idle (``roofline_refresh_s``): a probe reads the disk and the memory
bus flat out and keeps the cores busy, and run beside a request it would slow it and skew
the figures.

A request's figures (docs/performance.md "The live roofline"): over its decode passes,
the expert bytes read from disk and the weight bytes touched, a shared pass's bytes
divided among its members by their rows. ``disk_share`` = bytes read ÷ decode time ÷ the
disk probe (what ``colibri bench stream`` prints as the share of its roofline);
``memory_share`` = weight bytes ÷ decode time ÷ the memory probe; ``kernel_share`` =
decode tok/s ÷ the kernel-bound tok/s (one row a token out: a batched pass's other
members and rejected drafts are arithmetic it leaves out); ``roofline_share`` is tok/s
over the lowest of the disk-, memory- and kernel-bound tok/s, which is the largest of
the shares, and ``bound`` names it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import trio

from colibrid.engine.events import GenStats
from colibrid.store.experts import expert_tensor_names
from colibrid.store.options import split_bytes
from colibrid.store.read_probe import probe
from colibrid.store.telemetry import Counters

if TYPE_CHECKING:
    from colibrid.engine.engine import Engine

PROBE_READS = 64  # expert-sized direct reads a disk probe makes (as bench stream's)
MEMORY_PROBE_BYTES = 1 << 29  # the buffer the memory probe reads (as bench decode's)


@dataclass(frozen=True)
class Ceilings:
    """What this machine can do for the loaded model, measured by the daemon."""

    disk_gbs: float | None  # None: the store reads no experts from disk (resident)
    memory_gbs: float
    kernel_tok_s: float | None  # None: the kernels are not the CPU backend's
    dense_bytes: int  # weight bytes a pass reads besides the routed experts
    expert_bytes: int  # one routed expert as the store holds it
    probes: int  # measurements since the daemon started (STATUS: never during a request)
    measured_at: float  # time.time() of the measurement
    probe_s: float  # how long it took

    def as_json(self) -> dict[str, Any]:
        return {
            "disk_gbs": None if self.disk_gbs is None else round(self.disk_gbs, 3),
            "memory_gbs": round(self.memory_gbs, 2),
            "kernel_tok_s": None if self.kernel_tok_s is None else round(self.kernel_tok_s, 2),
            "dense_mb": round(self.dense_bytes / 1e6, 3),
            "expert_mb": round(self.expert_bytes / 1e6, 4),
            "probes": self.probes,
            "measured_at": round(self.measured_at, 1),
            "probe_s": round(self.probe_s, 3),
        }


def dense_read_bytes(engine: Engine) -> int:
    """Bytes of the weights a pass reads that are not routed experts: every resident
    tensor but the MTP layer when it does not run, and of an untied embedding table one
    row (the head is read whole; a tied table is the head)."""
    from colibrid.engine.layout import mtp_prefix

    checkpoint = engine.checkpoint
    idle = mtp_prefix(engine.args, checkpoint)
    idle_prefixes = (idle,) if idle and not engine.mtp_on else ()
    dense, _ = split_bytes(checkpoint, expert_tensor_names(engine.experts.layout), idle_prefixes)
    if engine.args.trunk.tie_word_embeddings:
        return dense
    for info in checkpoint.infos():
        if info.name.endswith(("embed_tokens.weight", "embed_tokens.weight.qs")):
            dense -= info.nbytes - info.nbytes // max(1, info.shape[0])
    return dense


def measure(engine: Engine, probes: int) -> Ceilings:
    """Engine thread, with no request running: probe the disk (where experts stream),
    the memory bus and the kernels; ``probes`` is the count this measurement makes."""
    from colibrid.backends import native
    from colibrid.serve.kernel_ceiling import kernel_tok_s

    started = time.perf_counter()
    store = engine.experts
    disk = None
    if store.reads_experts():  # twice, the faster kept: bench stream's rule (a slow
        threads = store.pool.threads or 1  # moment of the drive must not flatter shares)
        disk = max(probe(store, PROBE_READS, threads, seed=s)[0] for s in (0, 1))
    memory = native.membw_probe(MEMORY_PROBE_BYTES)
    return Ceilings(
        disk_gbs=disk,
        memory_gbs=memory,
        kernel_tok_s=kernel_tok_s(engine),
        dense_bytes=dense_read_bytes(engine),
        expert_bytes=store.statistics().expert_bytes,
        probes=probes,
        measured_at=time.time(),
        probe_s=time.perf_counter() - started,
    )


@dataclass
class RequestShare:
    """A request's part of the passes it decoded in."""

    read_bytes: float = 0.0  # expert bytes read from disk
    weight_bytes: float = 0.0  # weight bytes touched (dense + looked-up experts)

    def figures(self, stats: GenStats, ceilings: Ceilings | None) -> dict[str, float | str]:
        """The DONE STAT fields (typed; empty without ceilings or decode steps)."""
        steps = stats.generated_tokens - 1
        if ceilings is None or steps <= 0 or stats.decode_s <= 0:
            return {}
        memory = self.weight_bytes / stats.decode_s / (ceilings.memory_gbs * 1e9)
        out: dict[str, float | str] = {"read_mb_tok": self.read_bytes / steps / 1e6}
        shares = {"memory": memory}
        if ceilings.disk_gbs:
            shares["disk"] = self.read_bytes / stats.decode_s / (ceilings.disk_gbs * 1e9)
            out["disk_share"] = shares["disk"]
        out["memory_share"] = memory
        if ceilings.kernel_tok_s:
            shares["kernels"] = steps / stats.decode_s / ceilings.kernel_tok_s
            out["kernel_share"] = shares["kernels"]
        bound = max(shares, key=lambda k: shares[k])
        out["roofline_share"] = shares[bound]
        out["bound"] = bound
        return out


def as_extras(figures: dict[str, float | str]) -> dict[str, str]:
    """The figures as DONE STAT ``key=value`` text (four significant digits: a slowed or
    resident request's shares are small, and must not read as zero)."""
    return {k: v if isinstance(v, str) else f"{v:.4g}" for k, v in figures.items()}


def lookups(c: Counters) -> int:
    return c.hits_pinned + c.hits_cache + c.hits_prefetched + c.misses


class PassMeter:
    """Divides each pass's bytes among its members (engine thread): the store's counters
    since the last pass, shared by rows; a prompt's rows take their part of the pass
    (so a decode sharing a pass with a prompt is charged its rows' part only) but no
    request's decode figures count it."""

    def __init__(self, counters: Counters) -> None:
        self._base = counters.copy()

    def charge(
        self,
        counters: Counters,
        rows: Sequence[tuple[RequestShare | None, int]],
        ceilings: Ceilings,
    ) -> None:
        """``rows``: each member's share (None for a prompt) and rows in the pass."""
        delta, self._base = counters.minus(self._base), counters.copy()
        total = sum(n for _, n in rows)
        if total <= 0:
            return
        weight = ceilings.dense_bytes + lookups(delta) * ceilings.expert_bytes
        for share, n in rows:
            if share is not None:
                share.read_bytes += delta.bytes_read * n / total
                share.weight_bytes += weight * n / total


class Activity(Protocol):
    @property
    def active(self) -> int: ...  # requests decoding or waiting for their prompt's leader


class ProbingHost(Protocol):
    """What the idle refresh needs of the engine host (serve.host.EngineHost, which owns
    this module's meter: declared here so the two do not import each other)."""

    @property
    def ceilings(self) -> Ceilings | None: ...

    def statistics(self) -> Activity: ...

    async def call(self, fn: Callable[[], Any]) -> Any: ...

    def refresh_ceilings(self) -> None: ...


async def refresh_when_idle(host: ProbingHost, every_s: float) -> None:
    """Re-measure the ceilings once they are ``every_s`` old and nothing is running: the
    engine thread checks again right before it probes (`EngineHost.refresh_ceilings`),
    so a request that arrived meanwhile is never probed beside. ``every_s`` <= 0: only at
    load."""
    if every_s <= 0:
        return
    while True:
        await trio.sleep(min(every_s, 5.0))
        ceilings = host.ceilings
        if ceilings is None or time.time() - ceilings.measured_at < every_s:
            continue
        if host.statistics().active:
            continue
        await host.call(host.refresh_ceilings)
