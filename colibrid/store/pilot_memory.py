"""What PILOT's measurements taught, kept for the next run of the same model and plan.

`--pilot auto` measures decode with PILOT on and off (store/pilot_switch.py). On a first
run that costs trial windows at the slower state: on a GLM-5-shaped model streamed at 3x
its budget, ~8% of a 48-token run against the better fixed mode. The answer depends on
the model, the budget plan (how many slots the cache and PILOT get), the reader threads
and the drive, so it is remembered per (model, plan): every measured window of a run,
whatever its mode (`on` and `off` runs measure too), updates the remembered milliseconds
a token of that state, and the next `auto` run of the same model and plan starts in the
state remembered faster, without trials. It still re-measures the other state now and
then (HOLD windows), so a remembered answer that stopped being true is corrected.

The file is small JSON (`$COLIBRI_HOME/profiles/MODEL/pilot.json`, beside the model's
usage profiles), written atomically at most every WRITE_EVERY_S seconds while decoding
(its fsync must not stall a token on a drive busy streaming experts) and when the store
closes; it keeps the most recent MAX_ENTRIES plans. A file that cannot be read is
ignored (and replaced at the next write); one that cannot be written costs the memory,
never the run.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from colibrid.paths import atomic_write

log = logging.getLogger("colibri.store")

VERSION = 1
MAX_ENTRIES = 32
WRITE_EVERY_S = 60.0


class PilotMemory:
    """The remembered seconds a token of decode took with PILOT on and off, for one
    (model, plan) ``key`` in the file at ``path``."""

    def __init__(self, path: Path, key: str) -> None:
        self.path = path
        self.key = key
        self._failed = False
        self._pending: dict[bool, float] = {}
        self._written = float("-inf")

    def load(self) -> dict[bool, float]:
        """The states measured before: {True: s/token with PILOT, False: without}."""
        entry = self._entries().get(self.key, {})
        found: dict[bool, float] = {}
        for state, name in ((True, "on_ms"), (False, "off_ms")):
            value = entry.get(name) if isinstance(entry, dict) else None
            if isinstance(value, (int, float)) and value > 0:
                found[state] = float(value) / 1e3
        return found

    def save(self, state: bool, seconds: float) -> None:
        """Remember ``state``'s latest figure (seconds a token) for this model and plan:
        written now when the last write is WRITE_EVERY_S old, else at the next or at
        `flush`."""
        self._pending[state] = seconds
        if time.monotonic() - self._written >= WRITE_EVERY_S:
            self.flush()

    def flush(self) -> None:
        """Write what is pending (the store calls it when it closes)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        self._written = time.monotonic()
        entries = self._entries()
        entry = entries.pop(self.key, {})
        entry = entry if isinstance(entry, dict) else {}
        for state, seconds in pending.items():
            entry["on_ms" if state else "off_ms"] = round(seconds * 1e3, 3)
        entry["updated"] = int(time.time())
        entries[self.key] = entry  # last: the most recent plans are kept
        while len(entries) > MAX_ENTRIES:
            entries.pop(next(iter(entries)))
        try:
            atomic_write(self.path, json.dumps({"version": VERSION, "entries": entries}))
        except OSError as exc:
            if not self._failed:  # once: a full disk costs the memory, not the run
                log.warning("colibri: PILOT's measurements not saved to %s: %s", self.path, exc)
            self._failed = True

    def _entries(self) -> dict[str, object]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != VERSION:
            return {}
        entries = data.get("entries")
        return dict(entries) if isinstance(entries, dict) else {}
