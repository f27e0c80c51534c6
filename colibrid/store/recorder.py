"""The usage recorder: every routing selection the store serves, counted once and fed
one way to whoever learns from it (the usage profile file, REPIN's session heat, the
daemon's profile book).

Why a pending list and not a counts copy: the daemon used to copy the whole counts
array around every token to find what changed; :meth:`UsageRecorder.take` hands over
only the selections since the last take (a few small arrays per layer).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from colibrid.store.usage import UsageProfile


class UsageRecorder:
    def __init__(self, n_layers: int, n_experts: int, layers: Iterable[int]) -> None:
        self.layers = frozenset(layers)
        self.n_experts = n_experts
        self.counts = np.zeros((n_layers, n_experts), dtype=np.int64)  # since the start
        self.profile: UsageProfile | None = None  # the .coli_usage being learned
        self.heat: np.ndarray | None = None  # REPIN's session heat, when REPIN is on
        self._pending: list[tuple[int, np.ndarray]] = []
        self._followed = False  # someone takes the selections (else none are kept)

    def learn(self, profile: UsageProfile, *, heat: bool) -> None:
        """From now on feed ``profile`` (the .coli_usage being learned) and, with ``heat``,
        REPIN's session heat (kept only when pins are planned: it costs a bincount a call)."""
        self.profile = profile
        self.heat = np.zeros(self.counts.shape, dtype=np.float64) if heat else None

    def check(self, layer: int, experts) -> np.ndarray:
        if layer not in self.layers:
            raise KeyError(f"layer {layer} has no routed experts in this store")
        idx = np.asarray(experts, dtype=np.int64).reshape(-1)
        if idx.size:
            # a decode step's union is a short list: Python's min/max beat two reductions
            source = experts if isinstance(experts, list) else idx.tolist()
            if min(source) < 0 or max(source) >= self.n_experts:
                raise KeyError(f"expert index out of range in {list(idx)}")
        return idx

    def record(self, layer: int, experts) -> np.ndarray:
        idx = self.check(layer, experts)
        if self.heat is None and idx.size <= 16:
            # a decode step's few experts: item increments beat a bincount over every expert
            row = self.counts[layer]
            for e in experts if isinstance(experts, list) else idx.tolist():
                row[e] += 1  # duplicates count twice
        else:
            selected = np.bincount(idx, minlength=self.n_experts)  # duplicates count twice
            self.counts[layer] += selected
            if self.heat is not None:
                self.heat[layer] += selected
        if self.profile is not None:
            self.profile.record(layer, idx)
        if self._followed:
            self._pending.append((layer, idx))
        return idx

    def end_pass(self) -> None:
        if self.profile is not None:
            self.profile.end_forward()

    def take(self) -> list[tuple[int, np.ndarray]]:
        """The selections since the last take: (layer, expert ids) per routed layer call.
        The first take starts the feed (before it nothing is kept: `counts` has it all)."""
        self._followed = True
        taken, self._pending = self._pending, []
        return taken
