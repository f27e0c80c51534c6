"""The seam between model code and wherever routed experts live.

Models ask an :class:`ExpertStore` for ``(layer, expert)`` and get three weights; they
never learn whether the bytes were resident, cached or just read from disk, and the store
never learns what a model is: it only sees the neutral :class:`ExpertLayout` (which
layers, how many experts, the two matrix sizes and a tensor-name template). A later
tiered store (disk streaming, cache, prefetch, pinning) implements the same protocol,
so swapping it in touches no model code and cannot change a token (DESIGN §4).

:class:`ResidentExpertStore` is the simplest store: every expert is validated and held
at construction (mmap views, or F32 arrays for checkpoints that need dequantising such
as FP8), which is what tests and small models use.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from colibrid.backends.base import QuantWeight
from colibrid.errors import ColibriError, ModelLoadError
from colibrid.store.checkpoint import Checkpoint

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
DEFAULT_TEMPLATE = "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def _check_template(template: str) -> None:
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise ValueError(f"bad expert name template {template!r}: {exc}") from None
    if fields != {"layer", "expert", "proj"}:
        raise ValueError(
            f"expert name template {template!r} must use exactly {{layer}}, {{expert}}, {{proj}}"
        )


@dataclass(frozen=True)
class ExpertLayout:
    """Where routed experts are and how big they are; no model knowledge beyond that.

    gate/up are [ffn, hidden], down is [hidden, ffn]. MTP layers use the same names
    with layer == num_hidden_layers, so they are just another entry of ``moe_layers``
    (or of a store's ``extra_layers`` when their names differ).
    """

    moe_layers: tuple[int, ...]
    n_experts: int
    hidden: int
    ffn: int
    name_template: str = DEFAULT_TEMPLATE

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        if any(not isinstance(x, int) or x < 0 for x in self.moe_layers):
            raise ValueError(f"moe_layers must be non-negative ints, got {self.moe_layers}")
        if len(set(self.moe_layers)) != len(self.moe_layers):
            raise ValueError(f"moe_layers has duplicates: {self.moe_layers}")
        for field in ("n_experts", "hidden", "ffn"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        _check_template(self.name_template)

    def shape(self, proj: str) -> tuple[int, int]:
        return (self.hidden, self.ffn) if proj == "down_proj" else (self.ffn, self.hidden)

    def tensor_name(self, layer: int, expert: int, proj: str, template: str | None = None) -> str:
        return (template or self.name_template).format(layer=layer, expert=expert, proj=proj)


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert's SwiGLU matrices: gate/up [ffn, hidden], down [hidden, ffn]."""

    gate: QuantWeight
    up: QuantWeight
    down: QuantWeight

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


@runtime_checkable
class ExpertStore(Protocol):
    """What model code may ask of any expert store."""

    def get(self, layer: int, expert: int) -> ExpertWeights: ...

    def get_many(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]: ...

    def record(self, layer: int, experts: Sequence[int]) -> None:
        """Count one routing selection of ``experts`` in ``layer`` (usage profile feed)."""
        ...


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
            _check_template(template)
            templates[layer] = template
        self._experts: dict[int, list[ExpertWeights]] = {
            layer: [self._load(checkpoint, layer, e, template) for e in range(layout.n_experts)]
            for layer, template in sorted(templates.items())
        }
        n_layers = max(templates, default=-1) + 1
        self.counts = np.zeros((n_layers, layout.n_experts), dtype=np.int64)

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
        return tuple(self._experts)

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

    def record(self, layer: int, experts: Sequence[int]) -> None:
        if layer not in self._experts:
            raise KeyError(f"layer {layer} has no routed experts in this store")
        idx = np.asarray(experts, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.layout.n_experts):
            raise KeyError(f"expert index out of range in {list(idx)}")
        np.add.at(self.counts[layer], idx, 1)
