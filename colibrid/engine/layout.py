"""The engine's description of a checkpoint's routed experts for the store (an
`ExpertLayout`: which layers, how many experts, their tensor names and shapes) and where
its MTP layer lives. Shared by `Engine.load` and `validate`, which checks the same layout
before a weight is mapped."""

from __future__ import annotations

from typing import Any

from colibrid.models.mtp import MTPLayer
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.experts import ExpertLayout


def mtp_prefix(args: Any, checkpoint: Checkpoint) -> str | None:
    """The tensor-name prefix of the checkpoint's MTP layer, when it has one."""
    mtp = args.trunk.num_hidden_layers
    if args.trunk.num_mtp_layers and MTPLayer.present(checkpoint, mtp):
        return f"model.layers.{mtp}."
    return None


def expert_layout(args: Any, checkpoint: Checkpoint, *, with_mtp: bool = False) -> ExpertLayout:
    """The neutral description of the routed experts the store serves. The MTP layer's
    experts are left out (``with_mtp`` puts them in, for validation): the MTP layer is
    loaded but never run until speculation uses it, so the store must not plan, pin or
    count them (they would take slots and budget for nothing)."""
    trunk, moe = args.trunk, args.moe
    layers = [layer for layer, is_moe in enumerate(args.is_moe) if is_moe]
    drafting: tuple[int, ...] = ()
    if with_mtp and mtp_prefix(args, checkpoint) is not None:
        layers.append(trunk.num_hidden_layers)
        drafting = (trunk.num_hidden_layers,)
    return ExpertLayout(
        moe_layers=tuple(layers),
        n_experts=moe.n_routed_experts,
        hidden=trunk.hidden_size,
        ffn=moe.moe_intermediate_size,
        name_template=f"model.layers.{{layer}}.{moe.module}.experts.{{expert}}.{{proj}}.weight",
        proj_names=moe.expert_names,
        draft_layers=drafting,
    )
