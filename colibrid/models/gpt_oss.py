"""gpt-oss (gpt-oss-20b, gpt-oss-120b): GQA with biases on all four projections and a
learned attention sink per head, sliding-window and full attention layers as
`layer_types` says (alternating by default), rotate_half YaRN RoPE, and every layer a
MoE whose router has a bias and takes the softmax over its top-k logits (the renormalised
top-k of the full softmax, which is the same thing), with experts that have biases and a
clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`). No shared expert, no dense layer.

transformers stores the experts fused and transposed (`experts.gate_up_proj` [E, D, 2F],
gate and up interleaved; `experts.down_proj` [E, F, D]); the engine serves the per-expert
layout `colibri convert` writes (`mlp.experts.E.{gate,up,down}_proj.weight`), and keeps
the expert biases under their transformers names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from colibrid.models import gqa_model
from colibrid.models.base import ConfigReader, Ops, WeightSource
from colibrid.models.common import read_softmax_moe, read_trunk, read_window
from colibrid.models.gqa_model import GQAModelArgs, read_heads
from colibrid.models.layers.biased_moe import ClampedGLU
from colibrid.models.layers.gqa import GQAAttention, GQAShape

ARCH = "gpt_oss"
build = gqa_model.build

LAYER_TYPES = {"sliding_attention", "full_attention"}

# GptOssConfig's defaults where they differ from what the shared readers assume (a saved
# config.json spells them all out; these cover a hand-written one).
DEFAULTS: dict[str, Any] = {
    "head_dim": 64,
    "num_key_value_heads": 8,
    "num_experts_per_tok": 4,
    "rms_norm_eps": 1e-5,
    "sliding_window": 128,
    "attention_bias": True,
    "max_position_embeddings": 131072,
    "rope_theta": 150000.0,
}
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@dataclass(frozen=True)
class ModelArgs(GQAModelArgs):
    windows: tuple[int | None, ...] = ()  # per layer: the sliding window, or None (full)

    def attention_at(self, src: WeightSource, ops: Ops, layer: int) -> GQAAttention:
        shape = dataclasses.replace(self.attention, window=self.windows[layer])
        return GQAAttention(src, ops, f"model.layers.{layer}.self_attn", shape)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if isinstance(config, dict):
            config = {**DEFAULTS, **config}
            if config.get("rope_parameters") is None and config.get("rope_scaling") is None:
                config["rope_parameters"] = dict(DEFAULT_ROPE, rope_theta=config["rope_theta"])
        r = ConfigReader(config, ARCH)
        trunk = read_trunk(r)
        h = read_heads(r, trunk.hidden_size)
        bias = r.bool("attention_bias", True)
        attention = GQAShape(
            hidden=trunk.hidden_size,
            heads=h.heads,
            kv_heads=h.kv_heads,
            head_dim=h.head_dim,
            bias=bias,
            qk_norm=False,
            eps=trunk.rms_norm_eps,
            o_bias=bias,
            sinks=True,
        )
        moe = dataclasses.replace(
            read_softmax_moe(
                r, width_key="intermediate_size", default_top_k=4, norm_topk_prob=True
            ),
            router="router",
            router_bias=True,
            glu=ClampedGLU(
                alpha=r.float("swiglu_alpha", 1.702, lo=-1e6, hi=1e6),
                limit=r.float("swiglu_limit", 7.0, lo=0.0, hi=1e6),
            ),
        )
        return cls(
            trunk=trunk,
            moe=moe,
            is_moe=(True,) * trunk.num_hidden_layers,
            attention=attention,
            rope=r.rope(),
            rotary_dim=h.head_dim,
            windows=layer_windows(r, trunk.num_hidden_layers),
        )


def layer_windows(r: ConfigReader, n_layers: int) -> tuple[int | None, ...]:
    """Each layer's window: `sliding_window` on the "sliding_attention" layers of
    `layer_types` (default: the even layers, as GptOssConfig), None on the full ones."""
    kinds = r.str_list("layer_types", n_layers, LAYER_TYPES)
    if kinds is None:
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    window = read_window(r)
    return tuple(window if k == "sliding_attention" else None for k in kinds)
