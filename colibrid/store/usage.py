"""The usage profile: how often each (layer, expert) was chosen, and which experts are
chosen together — the memory AUTOPIN and REPIN learn from.

Format (upstream ``.coli_usage``, docs/formats.md, so users' existing histories are read):
text, three numeric fields a line; header records ``-1 <n_layers> <n_experts>`` and
``-2 <format_version> <engine_id_hash>`` (FNV-1a 32 of the model type: ``glm_moe_dsa``
-> 3815245270), then ``<layer> <expert> <count>`` for non-zero counts. Header-less
legacy files are accepted; an empty history is a zero-byte file. Co-occurrence (within a
layer, and layer L -> next MoE layer) goes to a sidecar ``<path>.cooc.npz`` so old readers
never see a fourth field.

Every write is temp file + fsync + rename (+ directory fsync), so a kill -9 at any moment
leaves either the old or the new file, never a torn one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from colibrid.errors import ColibriError
from colibrid.paths import atomic_write

log = logging.getLogger("colibri.store")

FORMAT_VERSION = 1
MAX_LINES = 10_000_000


class UsageError(ColibriError):
    """A usage profile that cannot be read or belongs to another model."""


def engine_id_hash(model_type: str) -> int:
    """FNV-1a 32-bit of the model type, as upstream writes in the ``-2`` header."""
    h = 0x811C9DC5
    for b in model_type.encode("utf-8"):
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def usage_text(counts: np.ndarray, model_type: str) -> bytes:
    """The `.coli_usage` text of selection counts [layers, experts] (docs/formats.md):
    the two header records, then `<layer> <expert> <count>` for non-zero counts; an empty
    history is an empty file, as upstream writes it."""
    if not counts.any():
        return b""
    lines = [
        f"-1 {counts.shape[0]} {counts.shape[1]}",
        f"-2 {FORMAT_VERSION} {engine_id_hash(model_type)}",
    ]
    layers, experts = np.nonzero(counts)
    lines += [f"{la} {e} {counts[la, e]}" for la, e in zip(layers, experts, strict=True)]
    return ("\n".join(lines) + "\n").encode("ascii")


class UsageProfile:
    """Counts [n_layers, n_experts] (int64) plus co-occurrence [n_layers, E, E] (uint32)."""

    def __init__(
        self,
        n_layers: int,
        n_experts: int,
        model_type: str = "",
        moe_layers: Sequence[int] = (),
        cooc: bool = True,
    ) -> None:
        self.n_layers, self.n_experts = n_layers, n_experts
        self.model_type = model_type
        self.counts = np.zeros((n_layers, n_experts), dtype=np.int64)
        self.cooc = cooc
        self.within = np.zeros(
            (n_layers, n_experts, n_experts) if cooc else (0, 0, 0), dtype=np.uint32
        )
        self.next = np.zeros_like(self.within)
        layers = sorted(moe_layers)
        self._successor = {a: b for a, b in zip(layers, layers[1:], strict=False)}
        self._last: tuple[int, np.ndarray] | None = None
        self.dirty = False

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def record(self, layer: int, experts: Sequence[int]) -> None:
        idx = np.asarray(experts, dtype=np.int64).reshape(-1)
        np.add.at(self.counts[layer], idx, 1)
        if self.cooc and idx.size:
            u = np.unique(idx)
            self.within[layer][np.ix_(u, u)] += np.uint32(1)
            if self._last is not None and self._successor.get(self._last[0]) == layer:
                self.next[self._last[0]][np.ix_(self._last[1], u)] += np.uint32(1)
            self._last = (layer, u)
        self.dirty = True

    def end_forward(self) -> None:
        """A token boundary: the next record starts a new chain of layers."""
        self._last = None

    # ---- text format ------------------------------------------------------------------
    def to_text(self) -> bytes:
        return usage_text(self.counts, self.model_type)

    def save(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        atomic_write(path, self.to_text())
        if self.cooc:
            import io

            buf = io.BytesIO()
            np.savez(buf, within=self.within, next=self.next)
            atomic_write(cooc_path(path), buf.getvalue())
        self.dirty = False

    def merge_file(self, path: str | os.PathLike[str], *, trusted: bool = False) -> int:
        """Add a saved history (ours or upstream's) to the counts; returns selections read.

        A history written for another model (its ``-1`` sizes or ``-2`` hash differ) is
        refused by name unless ``trusted``; records outside our sizes are refused too.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="ascii")
        except FileNotFoundError:
            return 0
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{path}: cannot read usage profile ({exc})") from None
        added = parse_counts(text, path, self.counts.shape, self.model_type, trusted=trusted)
        self.counts += added
        side = cooc_path(path)
        if self.cooc and side.is_file():
            try:
                with np.load(side) as z:
                    if z["within"].shape == self.within.shape:
                        self.within += z["within"].astype(np.uint32)
                        self.next += z["next"].astype(np.uint32)
            except (OSError, ValueError, KeyError):
                pass  # the sidecar is a cache of nice-to-have statistics
        return int(added.sum())


def parse_counts(
    text: str,
    where: Path,
    shape: tuple[int, ...],
    model_type: str = "",
    *,
    trusted: bool = False,
    lenient: bool = False,
) -> np.ndarray:
    """Selection counts [layers, experts] from `.coli_usage` text (ours or upstream's).

    Strict (the default): a malformed line, a record outside ``shape`` or, unless
    ``trusted``, a header for another model raises UsageError naming the file and line.
    Lenient (the daemon's own profiles, which must never stop a start): such lines are
    skipped, and how many is logged.
    """
    n_layers, n_experts = shape
    counts = np.zeros(shape, dtype=np.int64)
    skipped = 0
    for n, line in enumerate(text.splitlines()[:MAX_LINES], 1):
        if not line.strip():
            continue
        try:
            try:
                a, b, c = (int(p) for p in line.split())
            except ValueError:
                raise UsageError(
                    f"{where}:{n}: expected three integers, got {line[:60]!r}"
                ) from None
            if a == -1 and not trusted and (b, c) != (n_layers, n_experts):
                raise UsageError(
                    f"{where}: history is for {b} layers x {c} experts, this "
                    f"model has {n_layers} x {n_experts}"
                )
            if a == -2 and not trusted and model_type and c != engine_id_hash(model_type):
                raise UsageError(
                    f"{where}: history belongs to another engine/model (id {c}, "
                    f"expected {engine_id_hash(model_type)} for {model_type})"
                )
            if a < 0:
                continue
            if not (a < n_layers and 0 <= b < n_experts and c >= 0):
                raise UsageError(f"{where}:{n}: record {a} {b} {c} is outside this model")
        except UsageError:
            if not lenient:
                raise
            skipped += 1
            continue
        counts[a, b] += c
    if skipped:
        log.warning("%s: skipped %d unreadable or foreign line(s)", where, skipped)
    return counts


def cooc_path(path: Path) -> Path:
    return path.with_name(path.name + ".cooc.npz")
