"""Mixtral (8x7B, 8x22B): GQA without biases or qk-norm, full rotate_half RoPE, an optional
sliding attention window, and every layer a softmax top-k MoE whose chosen probabilities
are always renormalised to sum 1. Checkpoints keep the MoE under `block_sparse_moe` with
the experts' gate, up and down projections named w1, w3 and w2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colibrid.models import gqa_model
from colibrid.models.base import ConfigReader
from colibrid.models.common import read_softmax_moe, read_trunk, read_window, require_silu
from colibrid.models.gqa_model import GQAModelArgs, read_heads
from colibrid.models.layers.gqa import GQAShape

ARCH = "mixtral"
MOE_MODULE = "block_sparse_moe"
EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down
build = gqa_model.build


@dataclass(frozen=True)
class ModelArgs(GQAModelArgs):
    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        r = ConfigReader(config, ARCH)
        require_silu(r)
        trunk = read_trunk(r)
        h = read_heads(r, trunk.hidden_size, kv_default=8)
        attention = GQAShape(
            hidden=trunk.hidden_size,
            heads=h.heads,
            kv_heads=h.kv_heads,
            head_dim=h.head_dim,
            bias=False,
            qk_norm=False,
            eps=trunk.rms_norm_eps,
            window=read_window(r),
        )
        moe = read_softmax_moe(
            r,
            width_key="intermediate_size",  # Mixtral's experts are its only FFNs
            default_top_k=2,
            norm_topk_prob=True,
            module=MOE_MODULE,
            expert_names=EXPERT_NAMES,
        )
        return cls(
            trunk=trunk,
            moe=moe,
            is_moe=(True,) * trunk.num_hidden_layers,
            attention=attention,
            rope=r.rope(),
            rotary_dim=h.head_dim,
        )
