"""The model every GQA family builds (GLM-4.x, Qwen3-MoE, Mixtral, OLMoE): the shared
decoder stack with a GQA block per layer and rotate_half RoPE. A family module only reads
its config into `GQAModelArgs`; how the arguments become layers is written once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colibrid.models.base import MAX_HEADS, ConfigReader, ExpertSource, Ops, WeightSource
from colibrid.models.common import TrunkArgs
from colibrid.models.layers.gqa import GQAAttention, GQAShape
from colibrid.models.transformer import MoEArgs, Transformer, build_transformer


@dataclass(frozen=True)
class GQAModelArgs:
    trunk: TrunkArgs
    moe: MoEArgs
    is_moe: tuple[bool, ...]
    attention: GQAShape
    rope: dict[str, Any]
    rotary_dim: int

    def attention_at(self, src: WeightSource, ops: Ops, layer: int) -> GQAAttention:
        return GQAAttention(src, ops, f"model.layers.{layer}.self_attn", self.attention)

    def cache_layout_at(self, src: WeightSource, layer: int) -> dict[str, tuple[int, ...]]:
        """What layer ``layer`` caches per position (a sliding window caches the same)."""
        return self.attention.cache_layout()


@dataclass(frozen=True)
class Heads:
    """Attention head counts: H query heads, G KV heads (G divides H), d dims per head."""

    heads: int
    kv_heads: int
    head_dim: int


def read_heads(r: ConfigReader, hidden: int, *, kv_default: int | None = None) -> Heads:
    """`num_attention_heads`, `num_key_value_heads` (``kv_default`` when absent, else one
    per query head) and `head_dim` (absent or null: hidden / heads, as transformers)."""
    heads = r.int("num_attention_heads", hi=MAX_HEADS)
    kv_heads = r.int("num_key_value_heads", kv_default or heads, hi=heads)
    if heads % kv_heads:
        raise r._fail("num_key_value_heads", f"= {kv_heads} does not divide {heads} heads")
    head_dim = r.optional_int("head_dim")
    if head_dim is None:
        if hidden < heads:
            raise r._fail("num_attention_heads", f"= {heads} exceeds hidden_size = {hidden}")
        head_dim = hidden // heads
    return Heads(heads, kv_heads, head_dim)


def build(args: GQAModelArgs, src: WeightSource, experts: ExpertSource, ops: Ops) -> Transformer:
    return build_transformer(args, src, experts, ops, args.rotary_dim)
