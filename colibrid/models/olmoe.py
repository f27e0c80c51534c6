"""OLMoE (OLMoE-1B-7B): GQA whose q and k RMSNorms span the whole projections (all heads'
dims at once, not per head), full rotate_half RoPE, and every layer a softmax top-k MoE
(`norm_topk_prob` usually false: the gates are the chosen experts' probabilities)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colibrid.models import gqa_model
from colibrid.models.base import ConfigReader
from colibrid.models.common import read_softmax_moe, read_trunk, require_silu
from colibrid.models.gqa_model import GQAModelArgs, read_heads
from colibrid.models.layers.gqa import GQAShape

ARCH = "olmoe"
build = gqa_model.build


@dataclass(frozen=True)
class ModelArgs(GQAModelArgs):
    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        r = ConfigReader(config, ARCH)
        require_silu(r)
        trunk = read_trunk(r)
        h = read_heads(r, trunk.hidden_size)
        # transformers sizes q_norm by hidden_size and k_norm by (hidden / H) * G: the norms
        # fit the projections only when d = hidden / H
        if h.heads * h.head_dim != trunk.hidden_size:
            raise r._fail("head_dim", f"= {h.head_dim} must be hidden_size / num_attention_heads")
        if r.config.get("clip_qkv") is not None:
            raise r._fail("clip_qkv", "is not supported (only null: no clipping)")
        bias = r.bool("attention_bias", False)
        attention = GQAShape(
            hidden=trunk.hidden_size,
            heads=h.heads,
            kv_heads=h.kv_heads,
            head_dim=h.head_dim,
            bias=bias,
            qk_norm=True,
            eps=trunk.rms_norm_eps,
            o_bias=bias,  # `attention_bias` puts a bias on o_proj too
            qk_norm_whole=True,
        )
        return cls(
            trunk=trunk,
            moe=read_softmax_moe(
                r, width_key="intermediate_size", default_top_k=8, norm_topk_prob=None
            ),
            is_moe=(True,) * trunk.num_hidden_layers,
            attention=attention,
            rope=r.rope(),
            rotary_dim=h.head_dim,
        )
