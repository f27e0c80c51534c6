"""The fully resident expert store: every expert validated and held at construction
(mmap views, or F32 arrays for checkpoints that need dequantising such as FP8).

Why it exists beside the tiered store: when the experts fit (tests, small models, a
big-RAM machine) the page cache is the cache and nothing needs planning; it is also the
reference every placement is compared with, token for token (docs/architecture.md, invariants).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

import numpy as np

from colibrid.backends.base import ResidentExperts
from colibrid.errors import ColibriError, ModelLoadError
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.experts import PROJECTIONS, ExpertLayout, ExpertWeights, check_template
from colibrid.store.pins import PinBudget, PinController
from colibrid.store.protocol import UsageDelta
from colibrid.store.recorder import UsageRecorder
from colibrid.store.telemetry import Counters, StoreStats, snapshot


class ResidentExpertStore:
    """Every expert of every listed layer held in memory, validated at construction.

    ``extra_layers`` maps further layer indices to their own name templates (e.g. an MTP
    layer stored under a different prefix); they share the layout's sizes.
    Selections passed to :meth:`record` are counted in ``counts`` [n_layers, n_experts]
    (int64), where n_layers covers every layer index served.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        layout: ExpertLayout,
        *,
        extra_layers: dict[int, str] | None = None,
    ) -> None:
        self.layout = layout
        templates = {layer: layout.name_template for layer in layout.moe_layers}
        for layer, template in (extra_layers or {}).items():
            if not isinstance(layer, int) or layer < 0 or layer in templates:
                raise ValueError(f"extra layer {layer!r} is invalid or already a MoE layer")
            check_template(template)
            templates[layer] = template
        self._experts: dict[int, list[ExpertWeights]] = {
            layer: [self._load(checkpoint, layer, e, template) for e in range(layout.n_experts)]
            for layer, template in sorted(templates.items())
        }
        self._layers = {layer: ResidentExperts(row) for layer, row in self._experts.items()}
        profiled = [la for la in self._experts if la not in layout.draft_layers]
        self.recorder = UsageRecorder(max(profiled, default=-1) + 1, layout.n_experts, profiled)
        self.counts = self.recorder.counts
        self.pins = PinController(PinBudget("off", 0, 0))
        self.stats = Counters()

    def _load(self, ckpt: Checkpoint, layer: int, expert: int, template: str) -> ExpertWeights:
        mats = []
        for proj in PROJECTIONS:
            name = self.layout.tensor_name(layer, expert, proj, template)
            if not ckpt.has(name):
                raise ModelLoadError(f"{ckpt.dir}: missing expert tensor {name!r}")
            try:
                mats.append(ckpt.weight(name, self.layout.shape(proj)))
            except ColibriError as exc:
                raise ModelLoadError(str(exc)) from None
        return ExpertWeights(*mats)

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers usage profiles and pins cover (drafting layers served, not counted)."""
        return tuple(la for la in self._experts if la not in self.layout.draft_layers)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        try:
            row = self._experts[layer]
        except KeyError:
            raise KeyError(f"layer {layer} has no routed experts in this store") from None
        if not 0 <= expert < len(row):
            raise KeyError(f"expert {expert} out of range [0, {len(row)}) in layer {layer}")
        return row[expert]

    def get_many(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        return [self.get(layer, int(e)) for e in experts]

    def iter_ready(self, layer: int, experts: Sequence[int]) -> Iterator[tuple[int, ExpertWeights]]:
        return iter([(int(e), self.get(layer, int(e))) for e in experts])

    def iter_groups(
        self, layer: int, experts: Sequence[int]
    ) -> Iterator[list[tuple[int, ExpertWeights]]]:
        return iter([[(int(e), self.get(layer, int(e))) for e in experts]])  # all in memory

    def resident(self, layer: int) -> ResidentExperts | None:
        return self._layers.get(layer)  # every expert stays: the layer is one Ops.moe call

    def record(self, layer: int, experts: Sequence[int]) -> None:
        if layer in self.layout.draft_layers:  # served, but no part of the usage profile
            self.stats.hits_pinned += len(experts)
            return
        idx = self.recorder.record(layer, experts)
        self.stats.hits_pinned += len(idx)  # the union: every lookup is a RAM hit

    def hint(self, layer: int, experts: Sequence[int]) -> int:
        return 0  # everything is in memory: nothing to read ahead

    def between_tokens(self, wall_s: float = 0.0, attention_s: float = 0.0, rows: int = 1) -> None:
        if rows:  # rows 0: a speculative draft's pass, not a step of any answer
            self.stats.tokens += 1
            self.stats.token_wall_s += wall_s
            self.stats.attention_s += attention_s
        self.recorder.end_pass()

    def abort_pass(self) -> None:
        pass  # nothing moves: the experts are all resident

    def request_finished(self) -> None:
        pass

    def take_usage(self) -> UsageDelta:
        return self.recorder.take()

    def pinned_keys(self) -> list[tuple[int, int]]:
        return []

    def apply_pins(self, counts: np.ndarray) -> int:
        """Nothing to pin: every expert stays in RAM (the controller's rule is off)."""
        self.pins.choose(counts, self.layers)
        return 0

    def streams(self) -> bool:
        return False

    def reads_experts(self) -> bool:
        return False  # the checkpoint's mapping is the memory

    def statistics(self, since: Counters | None = None) -> StoreStats:
        c = self.stats if since is None else self.stats.minus(since)
        total = len(self._experts) * self.layout.n_experts
        first = next(iter(self._experts.values()), [])
        size = first[0].nbytes if first else 0
        snap = snapshot(
            c,
            cache_per_layer=self.layout.n_experts,
            cache_bytes=total * size,
            pinned=0,
            io_mode="resident",
            policy="-",
            memwatch="off (experts resident)",  # nothing to shrink: the page cache is the cache
        )
        return replace(
            snap,
            resident_experts=total,
            expert_bytes=size,
            total_experts=total,
            pin_note="resident: every expert is in RAM",
        )

    def close(self) -> None:
        pass
