"""A container's precision plan: which stored format each routed expert has, and its id.

Why an identity: with per-expert precision by heat (``colibri requant --by-heat``), two
containers of the same model can hold the same tensors at different precisions and so
compute different tokens. DESIGN §4 makes the plan part of the model's identity, never of
its placement: it is shown in ``colibri ps``, every ``DONE … STAT`` line and ``/metrics``,
and enters the prompt cache's identity (engine/kv_files.py), so KV computed under one
plan is never reused under another.

The id is derived from the stored bytes' formats alone (header sizes, dtypes and
``colibri.fmt`` stamps, the same rules the loader uses), never from a claim in a
manifest: what the daemon reports is what it computes with. It covers the main model's
routed experts (not the MTP layer's, which a plan never changes), in (layer, expert)
order; a uniform container has an id too, so "same id" means "same per-expert formats".
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from colibrid.store.checkpoint import Checkpoint
from colibrid.store.experts import PROJECTIONS, ExpertLayout

ID_HEX = 12  # 48 bits: short enough to read in a STAT line, ample for a user's variants


def format_label(name: str, group_size: int) -> str:
    """A stored format as one word: the container format name, with its group size when
    the name does not already say it (``int4-grouped-g64``, ``int8-row``, ``bf16``)."""
    if not group_size or f"g{group_size}" in name:
        return name
    return f"{name}-g{group_size}"


def stored_label(ckpt: Checkpoint, name: str, shape: tuple[int, int]) -> str:
    """The stored format of matrix ``name`` (header facts only, no data read)."""
    info = ckpt.info(name)
    if info.dtype == "U8" and ckpt.has(name + ".qs"):
        fmt = ckpt.container_format(name, shape)
        return format_label(fmt.name, fmt.group_size)
    return info.dtype.lower()


def expert_formats(ckpt: Checkpoint, layout: ExpertLayout) -> dict[tuple[int, int], str]:
    """{(layer, expert): format} of the main model's routed experts; an expert whose three
    matrices differ is labelled ``gate/up/down``."""
    out: dict[tuple[int, int], str] = {}
    for layer in layout.profiled_layers:
        for expert in range(layout.n_experts):
            labels = [
                stored_label(ckpt, layout.tensor_name(layer, expert, proj), layout.shape(proj))
                for proj in PROJECTIONS
            ]
            out[layer, expert] = labels[0] if len(set(labels)) == 1 else "/".join(labels)
    return out


def plan_id(formats: Mapping[tuple[int, int], str]) -> str:
    """The short stable id of per-expert formats: SHA-256 of ``layer expert format`` lines
    in (layer, expert) order, first ID_HEX hex digits."""
    text = "".join(f"{la} {e} {fmt}\n" for (la, e), fmt in sorted(formats.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:ID_HEX]


@dataclass(frozen=True)
class PrecisionPlan:
    """The precision plan a loaded container computes with."""

    id: str
    experts: tuple[tuple[str, int], ...]  # (format, how many experts), most common first

    @classmethod
    def of(cls, formats: Mapping[tuple[int, int], str]) -> PrecisionPlan:
        ranked = sorted(Counter(formats.values()).items(), key=lambda kv: (-kv[1], kv[0]))
        return cls(plan_id(formats), tuple(ranked))

    @property
    def uniform(self) -> bool:
        return len(self.experts) <= 1

    def describe(self) -> str:
        """``uniform int4-grouped-g64`` or ``mixed: 32 int4-grouped-g64, 32 q3-g64``."""
        if not self.experts:
            return "no routed experts"
        if self.uniform:
            return f"uniform {self.experts[0][0]}"
        return "mixed: " + ", ".join(f"{n} {fmt}" for fmt, n in self.experts)

    def as_json(self) -> dict[str, object]:
        return {"id": self.id, "uniform": self.uniform, "experts": dict(self.experts)}


def plan_of(ckpt: Checkpoint, layout: ExpertLayout) -> PrecisionPlan:
    return PrecisionPlan.of(expert_formats(ckpt, layout))
