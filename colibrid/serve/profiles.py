"""Per-domain usage profiles: how often each (layer, expert) was selected, per model.

A profile is a usage history (docs/formats.md) kept in upstream's `.coli_usage` text
format under ``$COLIBRI_HOME/profiles/<model>/<name>.coli_usage``, written atomically.
Each request counts into the profile it names (or the active one): the store's usage
recorder hands the selections over after every engine step (one way: store -> book).
The active profile's counts are what the store's pin controller chooses pins from (on
the engine thread, `DaemonState._repin`); this module never touches the store.
Counts are added from the engine thread and read from the trio thread: one lock.

A save that cannot be written (a full disk, an I/O error, a read-only home) raises
PersistError naming the file; the counts stay in memory and the next save tries again.
The file on disk is the last complete one (writes are atomic), never a torn one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from colibrid.errors import ColibriError, PersistError
from colibrid.paths import atomic_write, persisting
from colibrid.store.usage import parse_counts, usage_text

log = logging.getLogger("colibrid.profiles")


class ProfileError(ColibriError):
    code = "NOT_FOUND"


def read_profile(path: Path, shape: tuple[int, int], model_type: str) -> np.ndarray:
    """Counts of a saved profile; unreadable lines are skipped (logged), never fatal."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return parse_counts(text, path, shape, model_type, lenient=True)


ACTIVE_FILE = "active"  # beside the profiles: the name `profile use` chose last


class ProfileBook:
    """The usage profiles of one model. ``active`` is the one requests count into; the
    last `profile use` is remembered in ``<directory>/active`` and wins over the
    configured default at the next start."""

    def __init__(
        self, directory: Path, shape: tuple[int, int], model_type: str, active: str
    ) -> None:
        self.directory = directory
        self.shape = shape
        self.model_type = model_type
        self.active = self._remembered() or active
        self._counts: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def _remembered(self) -> str | None:
        try:
            name = (self.directory / ACTIVE_FILE).read_text(encoding="utf-8").strip()
        except OSError:
            return None
        return name if name and name.replace("-", "").replace("_", "").isalnum() else None

    def use(self, name: str, *, create: bool = False) -> None:
        """Make `name` the active profile and remember it; a name with no profile (on disk
        or counted) is refused unless `create`. Raises PersistError when the choice
        cannot be written (it is still made for this run)."""
        if name not in self.names() and not create:
            known = ", ".join(self.names())
            raise ProfileError(
                f"no profile {name!r} (this model has: {known}); `colibri profile warm "
                f"{name}` learns a built-in domain, `colibri profile use {name} --create` "
                "starts an empty one"
            )
        with self._lock:
            self._get(name)
            self.active = name
        path = self.directory / ACTIVE_FILE
        with persisting(path):
            atomic_write(path, (name + "\n").encode())

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

    def add(self, profile: str | None, delta: Sequence[tuple[int, np.ndarray]]) -> None:
        """Count the selections the store took since the last step into ``profile``."""
        if not delta:
            return
        with self._lock:
            counts = self._get(profile or self.active)
            for layer, experts in delta:
                if layer < counts.shape[0]:
                    np.add.at(counts[layer], experts, 1)

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

    def save(self, name: str | None = None, *, source: str | None = None) -> Path:
        """Write `name` (default: the active profile); with `source`, copy its counts first.

        Raises PersistError naming the file when it cannot be written."""
        name = name or self.active
        with self._lock:
            if source is not None and source != name:
                self._counts[name] = self._get(source).copy()
            counts = self._get(name).copy()
        path = self.path(name)
        with persisting(path):
            atomic_write(path, usage_text(counts, self.model_type))
        return path

    def save_all(self) -> list[Path]:
        """Write every profile counted into; returns the files written.

        Every profile is tried even when one fails (the disk may have room for a small
        file, or only one file is read-only); the failures are raised together, as one
        PersistError whose message names each file."""
        with self._lock:
            names = list(self._counts)
        saved, failures = [], []
        for name in names:
            try:
                saved.append(self.save(name))
            except PersistError as exc:
                failures.append(str(exc))
        if failures:
            raise PersistError("; ".join(failures))
        return saved
