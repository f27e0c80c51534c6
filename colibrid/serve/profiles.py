"""Per-domain usage profiles: how often each (layer, expert) was selected, per model.

A profile is a usage history (DESIGN.md section 5) kept in upstream's `.coli_usage` text
format under ``$COLIBRI_HOME/profiles/<model>/<name>.coli_usage``, written atomically.
Each request counts into the profile it names (or the active one). The active profile
decides which experts are pinned: the `PinTarget` interface is all this module knows of
the store, so the tiered store can take the pin set without the profile code changing.
Counts are added from the engine thread and read from the trio thread: one lock.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Protocol

import numpy as np

from colibrid.errors import ColibriError
from colibrid.paths import atomic_write

FORMAT_VERSION = 1


class ProfileError(ColibriError):
    code = "NOT_FOUND"


class PinTarget(Protocol):
    """What pinning needs of an expert store: accept the set of experts to keep hot."""

    def set_pinned(self, experts: frozenset[tuple[int, int]]) -> None: ...


class RecordedPins:
    """Fallback target for a store without a pinned tier (the fully resident store): it
    records the chosen set so `ps` can show it; placement never changes tokens anyway."""

    def __init__(self) -> None:
        self.pinned: frozenset[tuple[int, int]] = frozenset()

    def set_pinned(self, experts: frozenset[tuple[int, int]]) -> None:
        self.pinned = experts


def choose_pins(counts: np.ndarray, budget: int) -> frozenset[tuple[int, int]]:
    """The `budget` most used experts with a non-zero count; ties go to the lowest index."""
    flat = counts.reshape(-1)
    order = np.lexsort((np.arange(flat.size), -flat))[: max(budget, 0)]
    n_experts = counts.shape[1]
    return frozenset((int(i) // n_experts, int(i) % n_experts) for i in order if flat[i] > 0)


def engine_id(model_dir: Path) -> str:
    return hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]


def write_usage(path: Path, counts: np.ndarray, ident: str) -> None:
    lines = [f"-1 {counts.shape[0]} {counts.shape[1]}", f"-2 {FORMAT_VERSION} {ident}"]
    lines += [f"{layer} {expert} {int(counts[layer, expert])}"
              for layer, expert in zip(*np.nonzero(counts), strict=True)]
    atomic_write(path, "\n".join(lines) + "\n")


def read_usage(path: Path, shape: tuple[int, int]) -> np.ndarray:
    """Counts from a `.coli_usage` file; lines outside `shape` or malformed are skipped."""
    counts = np.zeros(shape, dtype=np.int64)
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        fields = line.split()
        if len(fields) != 3:
            continue
        try:
            layer, expert, count = (int(f) for f in fields)
        except ValueError:
            continue
        if 0 <= layer < shape[0] and 0 <= expert < shape[1] and count > 0:
            counts[layer, expert] = count
    return counts


class ProfileBook:
    def __init__(self, directory: Path, shape: tuple[int, int], ident: str, active: str,
                 pins: PinTarget, pin_budget: int) -> None:
        self.directory = directory
        self.shape = shape
        self.ident = ident
        self.active = active
        self.pins = pins
        self.pin_budget = pin_budget
        self._counts: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def _get(self, name: str) -> np.ndarray:
        counts = self._counts.get(name)
        if counts is None:
            path = self.path(name)
            counts = read_usage(path, self.shape) if path.is_file() else np.zeros(
                self.shape, dtype=np.int64)
            self._counts[name] = counts
        return counts

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.coli_usage"

    def add(self, profile: str | None, delta: np.ndarray) -> None:
        if not delta.any():
            return
        with self._lock:
            self._get(profile or self.active)[: delta.shape[0]] += delta[: self.shape[0]]

    def counts(self, name: str) -> np.ndarray:
        with self._lock:
            return self._get(name).copy()

    def names(self) -> list[str]:
        on_disk = {p.name.removesuffix(".coli_usage") for p in self.directory.glob("*.coli_usage")}
        return sorted(on_disk | set(self._counts) | {self.active})

    def listing(self) -> list[dict[str, object]]:
        with self._lock:
            return [{"name": n, "selections": int(self._get(n).sum()), "active": n == self.active,
                     "saved": self.path(n).is_file()} for n in self.names()]

    def pin_set(self) -> frozenset[tuple[int, int]]:
        return choose_pins(self.counts(self.active), self.pin_budget)

    def save(self, name: str | None = None, *, source: str | None = None) -> Path:
        """Write `name` (default: the active profile); with `source`, copy its counts first."""
        name = name or self.active
        with self._lock:
            if source is not None and source != name:
                self._counts[name] = self._get(source).copy()
            counts = self._get(name).copy()
        write_usage(self.path(name), counts, self.ident)
        return self.path(name)

    def save_all(self) -> None:
        for name in list(self._counts):
            self.save(name)
