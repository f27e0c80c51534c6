"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): GQA with per-head qk RMSNorm
before full rotate_half RoPE, softmax top-k routing (`norm_topk_prob` renormalises the
chosen probabilities), no shared expert, and dense SwiGLU layers wherever
`mlp_only_layers` or `decoder_sparse_step` say so."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colibrid.models import gqa_model
from colibrid.models.base import MAX_LAYERS, ConfigReader
from colibrid.models.common import read_softmax_moe, read_trunk, read_window, require_silu
from colibrid.models.gqa_model import GQAModelArgs, read_heads
from colibrid.models.layers.gqa import GQAShape

ARCH = "qwen3_moe"
build = gqa_model.build


@dataclass(frozen=True)
class ModelArgs(GQAModelArgs):
    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        r = ConfigReader(config, ARCH)
        require_silu(r)
        trunk = read_trunk(r)
        h = read_heads(r, trunk.hidden_size, kv_default=4)
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
            # transformers keeps `sliding_window` only with `use_sliding_window`
            window=read_window(r) if r.bool("use_sliding_window", False) else None,
        )
        return cls(
            trunk=trunk,
            moe=read_softmax_moe(
                r, width_key="moe_intermediate_size", default_top_k=8, norm_topk_prob=None
            ),
            is_moe=sparse_layers(r, trunk.num_hidden_layers),
            attention=attention,
            rope=r.rope(),
            rotary_dim=h.head_dim,
        )


def sparse_layers(r: ConfigReader, n_layers: int) -> tuple[bool, ...]:
    """Layer i is MoE unless listed in `mlp_only_layers` or (i + 1) is not a multiple of
    `decoder_sparse_step` (transformers' Qwen3MoeDecoderLayer rule)."""
    dense = set(r.int_list("mlp_only_layers", hi=MAX_LAYERS))
    step = r.int("decoder_sparse_step", 1, hi=MAX_LAYERS)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))
