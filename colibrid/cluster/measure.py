"""What ``colibri plan`` knows, each figure with the measurement it comes from.

Why a module of its own: the plan's promise is that no figure is guessed. Sizes come
from the model's safetensors headers (the numbers ``colibri inspect`` prints), the RAM
budget from the rule the daemon itself applies, and the two speeds from the probes the
daemon's live roofline takes (serve/roofline.py): the O_DIRECT read probe over this
model's own expert extents, and the native memory-bandwidth probe. Each :class:`Figure`
carries its value and where it came from, so the plan prints them side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from colibrid.convert.inspect import Report, inspect
from colibrid.engine.layout import expert_layout, mtp_prefix
from colibrid.engine.validate import validate
from colibrid.store import budget as budgets
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.experts import expert_tensor_names
from colibrid.store.extents import NotStreamable
from colibrid.store.options import split_bytes
from colibrid.store.read_probe import probe
from colibrid.store.tiered import TieredStore

PROBE_READS = 64  # expert-sized direct reads a disk probe makes (as the daemon's)
PROBE_THREADS = 4  # the daemon's default I/O threads
MEMORY_PROBE_BYTES = 1 << 29  # the buffer the memory probe reads (as the daemon's)


@dataclass(frozen=True)
class Figure:
    """A number and the measurement it comes from."""

    value: float
    source: str


@dataclass(frozen=True)
class Measured:
    """The model's sizes and this machine's limits."""

    report: Report  # what `colibri inspect` prints
    weights: Figure  # bytes of the model's files (a GGUF export holds the same codes)
    token_bytes: Figure  # weight bytes one decoded token reads when all is resident
    cold_bytes: Figure  # routed-expert bytes a token reads when none is cached
    dense: Figure  # bytes that stay resident (all but routed experts) and are read
    ram: Figure  # this host's RAM budget, bytes
    memory_gbs: Figure
    disk_gbs: Figure | None  # None: experts of this format are not streamed

    @property
    def routed(self) -> int:
        return self.report.routed_bytes


def is_container(path: Path) -> bool:
    """Whether the folder is a colibri container (quantised weights carry ``.qs`` scales)
    rather than an original checkpoint that other engines load."""
    with Checkpoint.open(path) as ckpt:
        return any(n.endswith(".qs") for n in ckpt.names())


def dense_read_bytes(path: Path) -> int:
    """The weight bytes a decoded token reads besides the routed experts, as the daemon's
    live roofline counts them: every resident tensor but an MTP layer that does not run,
    and of an untied embedding table one row."""
    with Checkpoint.open(path) as ckpt:
        args = validate(ckpt)[0]
        layout = expert_layout(args, ckpt)
        idle = mtp_prefix(args, ckpt)
        dense, _ = split_bytes(ckpt, expert_tensor_names(layout), (idle,) if idle else ())
        if not args.trunk.tie_word_embeddings:
            for info in ckpt.infos():
                if info.name.endswith(("embed_tokens.weight", "embed_tokens.weight.qs")):
                    dense -= info.nbytes - info.nbytes // max(1, info.shape[0])
    return dense


def disk_probe(path: Path) -> Figure | None:
    """GB/s of O_DIRECT reads of random experts of this model, twice, the faster kept (the
    daemon's rule: a slow moment of the drive must not flatter the forecast)."""
    with Checkpoint.open(path) as ckpt:
        args = validate(ckpt)[0]
        layout = expert_layout(args, ckpt)
        if not layout.moe_layers:
            return None
        try:
            store = TieredStore(ckpt, layout, direct=True, io_threads=PROBE_THREADS)
        except NotStreamable:
            return None
        try:
            runs = [probe(store, PROBE_READS, PROBE_THREADS, seed=s) for s in (0, 1)]
            mode = store.files.mode
        finally:
            store.close()
    gbs, nbytes = max(runs)
    return Figure(
        gbs,
        f"disk probe: {PROBE_READS} random experts of this model ({nbytes / 1e6:.0f} MB, "
        f"{mode}, {PROBE_THREADS} threads), best of 2, this run",
    )


def memory_probe() -> Figure:
    from colibrid.backends import native

    gbs = native.membw_probe(MEMORY_PROBE_BYTES)
    return Figure(gbs, f"memory probe: {MEMORY_PROBE_BYTES >> 20} MiB read, best of 3, this run")


def ram_budget(ram_gb: float | None) -> Figure:
    total, source = budgets.resolve_total(ram_gb)
    if source == "auto":
        why = f"the daemon's auto budget: {budgets.AUTO_FRACTION:.0%} of MemAvailable now"
    else:
        why = "--ram-gb"
    return Figure(total, why)


def measure(path: Path, *, ram_gb: float | None = None) -> Measured:
    """Read the model's headers and run both probes (a few seconds)."""
    report = inspect(path)
    dense = dense_read_bytes(path)
    cold = report.expert_bytes_per_token
    heads = "safetensors headers"
    return Measured(
        report=report,
        weights=Figure(
            report.total_bytes,
            f"{heads}: {report.files} file" + ("s" if report.files != 1 else ""),
        ),
        token_bytes=Figure(
            dense + cold,
            f"{heads}: dense {dense / 1e9:.3f} GB + top-{report.top_k} experts x "
            f"{report.moe_layers} MoE layers",
        ),
        cold_bytes=Figure(
            cold, f"{heads}: top-{report.top_k} x {report.moe_layers} layers x expert size"
        ),
        dense=Figure(dense, f"{heads}: resident tensors a token reads"),
        ram=ram_budget(ram_gb),
        memory_gbs=memory_probe(),
        disk_gbs=disk_probe(path),
    )
