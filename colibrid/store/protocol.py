"""The one seam every expert store implements in full (see docs/architecture.md).

Why a single protocol: the model, the engine, PILOT, the daemon and the benchmarks used
to ask a store ``hasattr(store, "hint")`` or ``getattr(store, "counts", None)`` and took
a different path for each answer, so a store could half-implement the seam and no test
noticed. Every method here is implemented by :class:`~colibrid.store.resident.
ResidentExpertStore` and :class:`~colibrid.store.tiered.TieredStore`; where a store has
nothing to do (a resident store prefetches nothing) the method says so by doing nothing.
All calls come from the engine thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from colibrid.backends.base import ResidentExperts
from colibrid.store.experts import ExpertLayout, ExpertWeights
from colibrid.store.pins import PinController
from colibrid.store.telemetry import Counters, StoreStats

UsageDelta = list[tuple[int, np.ndarray]]  # (layer, expert ids) per routed layer call


@runtime_checkable
class ExpertStore(Protocol):
    layout: ExpertLayout
    counts: np.ndarray  # selections since start [n_layers, n_experts] (read-only view)
    pins: PinController
    stats: Counters  # the live counters (copy them to measure a span)

    @property
    def layers(self) -> tuple[int, ...]: ...

    def record(self, layer: int, experts: Sequence[int]) -> None:
        """Count one routing selection of ``experts`` in ``layer`` (the usage feed)."""

    def get(self, layer: int, expert: int) -> ExpertWeights: ...

    def get_many(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        """Every expert at once, valid until the next store call."""

    def iter_ready(self, layer: int, experts: Sequence[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """(expert, weights) pairs as they become available; misses start reading now."""

    def iter_groups(
        self, layer: int, experts: Sequence[int]
    ) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """Lists of pairs: every expert in memory now (possibly none), then misses as
        they land; each list valid until the next is asked for (the model's form)."""

    def resident(self, layer: int) -> ResidentExperts | None:
        """Every expert of ``layer`` when all of them stay in memory (the resident store),
        so the model may run the layer in one ``Ops.moe`` call; None where experts move."""

    def hint(self, layer: int, experts: Sequence[int]) -> int:
        """PILOT: ``layer`` will probably choose ``experts``; returns reads started."""

    def between_tokens(self, wall_s: float = 0.0, attention_s: float = 0.0, rows: int = 1) -> None:
        """A forward pass of ``rows`` tokens ended (also after a failed one); ``rows`` 0 is
        a pass no answer steps through (a speculative drafter's): its experts are kept,
        but it is not counted or timed as a token."""

    def abort_pass(self) -> None:
        """A forward pass raised: leave the store as consistent as before the pass."""

    def request_finished(self) -> None:
        """A request boundary: persist learned usage, re-pin."""

    def take_usage(self) -> UsageDelta:
        """Selections since the last take (the daemon's profile book is fed from it)."""

    def pinned_keys(self) -> list[tuple[int, int]]:
        """The (layer, expert) keys pinned now."""

    def apply_pins(self, counts: np.ndarray) -> int:
        """Pin what the pin rule chooses for these usage counts; returns pins held."""

    def statistics(self, since: Counters | None = None) -> StoreStats:
        """Hit rates, reads, times and placement (``since``: a copy of ``stats`` then)."""

    def streams(self) -> bool:
        """Experts are read from disk during decode (the cache cannot hold them all)."""

    def reads_experts(self) -> bool:
        """The store reads experts from the checkpoint's files into slots it manages (the
        tiered store, even when its cache holds every expert), so a disk probe, a cache
        flush and a cache bound mean something; False where the file mapping is the
        memory (the resident store)."""

    def close(self) -> None: ...
