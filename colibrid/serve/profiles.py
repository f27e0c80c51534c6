"""Per-domain usage profiles: how often each (layer, expert) was selected, per model.

A profile is a usage history (DESIGN.md section 5) kept in upstream's `.coli_usage` text
format under ``$COLIBRI_HOME/profiles/<model>/<name>.coli_usage``, written atomically.
Each request counts into the profile it names (or the active one). The active profile
decides which experts are pinned: the `PinTarget` interface is all this module knows of
the store, so the tiered store can take the pin set without the profile code changing.
Counts are added from the engine thread and read from the trio thread: one lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from colibrid.errors import ColibriError
from colibrid.paths import atomic_write
from colibrid.store.usage import parse_counts, usage_text

log = logging.getLogger("colibrid.profiles")


class ProfileError(ColibriError):
    code = "NOT_FOUND"


class PinTarget(Protocol):
    """What pinning needs of an expert store: take the experts to keep hot (hottest first)
    and say which are pinned now. Called in the engine thread, between two steps."""

    pinned: Any  # a collection of (layer, expert)

    def set_pinned(self, experts: Sequence[tuple[int, int]]) -> None: ...


class RecordedPins:
    """Fallback target for a store without a pinned tier (the fully resident store): it
    records the chosen set so `ps` can show it; placement never changes tokens anyway."""

    def __init__(self) -> None:
        self.pinned: frozenset[tuple[int, int]] = frozenset()

    def set_pinned(self, experts: Sequence[tuple[int, int]]) -> None:
        self.pinned = frozenset(experts)


class StorePins:
    """Adapter for a store with a pinned tier (`colibrid.store.tiered.TieredStore`:
    `pin(keys)`, `unpin(key)`, `pinned`): unpins what left the hot set, then pins the
    newcomers hottest first while the store has room (its pin slots were sized at start)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    @property
    def pinned(self) -> frozenset[tuple[int, int]]:
        return frozenset(self.store.pinned)

    def set_pinned(self, experts: Sequence[tuple[int, int]]) -> None:
        want = list(experts)
        for key in [k for k in list(self.store.pinned) if k not in set(want)]:
            self.store.unpin(key)
        for key in want:
            if key in self.store.pinned:
                continue
            try:
                self.store.pin([key])
            except ColibriError as exc:  # no free slot: the pin budget is spent
                log.info("pinned %d experts; %s", len(self.store.pinned), exc)
                break


def pin_target(store: Any) -> PinTarget:
    if all(hasattr(store, name) for name in ("pin", "unpin", "pinned")):
        return StorePins(store)
    return RecordedPins()


def choose_pins(counts: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """The `budget` most used experts with a non-zero count, hottest first; ties go to the
    lowest (layer, expert)."""
    flat = counts.reshape(-1)
    order = np.lexsort((np.arange(flat.size), -flat))[: max(budget, 0)]
    n_experts = counts.shape[1]
    return [(int(i) // n_experts, int(i) % n_experts) for i in order if flat[i] > 0]


def read_profile(path: Path, shape: tuple[int, int], model_type: str) -> np.ndarray:
    """Counts of a saved profile; unreadable lines are skipped (logged), never fatal."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return parse_counts(text, path, shape, model_type, lenient=True)


class ProfileBook:
    def __init__(
        self,
        directory: Path,
        shape: tuple[int, int],
        model_type: str,
        active: str,
        pins: PinTarget,
        pin_budget: int,
    ) -> None:
        self.directory = directory
        self.shape = shape
        self.model_type = model_type
        self.active = active
        self.pins = pins
        self.pin_budget = pin_budget
        self._counts: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def _get(self, name: str) -> np.ndarray:
        counts = self._counts.get(name)
        if counts is None:
            path = self.path(name)
            counts = (
                read_profile(path, self.shape, self.model_type)
                if path.is_file()
                else np.zeros(self.shape, dtype=np.int64)
            )
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
            return [
                {
                    "name": n,
                    "selections": int(self._get(n).sum()),
                    "active": n == self.active,
                    "saved": self.path(n).is_file(),
                }
                for n in self.names()
            ]

    def pin_set(self) -> list[tuple[int, int]]:
        return choose_pins(self.counts(self.active), self.pin_budget)

    def save(self, name: str | None = None, *, source: str | None = None) -> Path:
        """Write `name` (default: the active profile); with `source`, copy its counts first."""
        name = name or self.active
        with self._lock:
            if source is not None and source != name:
                self._counts[name] = self._get(source).copy()
            counts = self._get(name).copy()
        atomic_write(self.path(name), usage_text(counts, self.model_type))
        return self.path(name)

    def save_all(self) -> None:
        for name in list(self._counts):
            self.save(name)
