"""What a routed expert is, neutrally: where experts are (:class:`ExpertLayout`) and one
expert's three weights (:class:`ExpertWeights`).

The store never learns what a model is: it only sees the layout (which layers, how many
experts, the two matrix sizes and a tensor-name template). The stores themselves are in
:mod:`colibrid.store.resident` and :mod:`colibrid.store.tiered`, both implementing
:class:`colibrid.store.protocol.ExpertStore` in full.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from colibrid.formats.weights import QuantWeight

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
DEFAULT_TEMPLATE = "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def check_template(template: str) -> None:
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
    # What {proj} reads for gate, up and down (PROJECTIONS order) in the stored names:
    # Mixtral's checkpoints call them w1, w3 and w2.
    proj_names: tuple[str, str, str] = PROJECTIONS
    # Layers served only for speculative drafts (the MTP layer): streamed and cached like
    # the others, but not part of usage profiles (whose shape is the main model's, as
    # upstream's files are) and never pinned.
    draft_layers: tuple[int, ...] = ()

    @property
    def profiled_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in self.moe_layers if layer not in self.draft_layers)

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        object.__setattr__(self, "draft_layers", tuple(self.draft_layers))
        if not set(self.draft_layers) <= set(self.moe_layers):
            raise ValueError(f"draft_layers {self.draft_layers} must be MoE layers")
        if any(not isinstance(x, int) or x < 0 for x in self.moe_layers):
            raise ValueError(f"moe_layers must be non-negative ints, got {self.moe_layers}")
        if len(set(self.moe_layers)) != len(self.moe_layers):
            raise ValueError(f"moe_layers has duplicates: {self.moe_layers}")
        for field in ("n_experts", "hidden", "ffn"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        check_template(self.name_template)
        object.__setattr__(self, "proj_names", tuple(self.proj_names))
        if len(self.proj_names) != len(PROJECTIONS) or len(set(self.proj_names)) != 3:
            raise ValueError(f"proj_names {self.proj_names} must be 3 distinct names")

    def shape(self, proj: str) -> tuple[int, int]:
        return (self.hidden, self.ffn) if proj == "down_proj" else (self.ffn, self.hidden)

    def tensor_name(self, layer: int, expert: int, proj: str, template: str | None = None) -> str:
        """The stored name of projection ``proj`` (one of PROJECTIONS) of an expert."""
        stored = self.proj_names[PROJECTIONS.index(proj)]
        return (template or self.name_template).format(layer=layer, expert=expert, proj=stored)


def expert_tensor_names(layout: ExpertLayout) -> set[str]:
    """The stored names of every routed expert's tensors in the layout's MoE layers, each
    matrix with its ``.qs`` scales (present in colibri containers only)."""
    return {
        layout.tensor_name(layer, e, proj) + suffix
        for layer in layout.moe_layers
        for e in range(layout.n_experts)
        for proj in PROJECTIONS
        for suffix in ("", ".qs")
    }


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert's SwiGLU matrices: gate/up [ffn, hidden], down [hidden, ffn]."""

    gate: QuantWeight
    up: QuantWeight
    down: QuantWeight

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes
