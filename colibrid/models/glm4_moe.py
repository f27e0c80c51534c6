"""GLM-4.5 / 4.6 / 4.7 (including Air): GQA with partial rotate_half RoPE, optional qk-norm
and attention bias, one dense first layer, then sigmoid-routed MoE with a shared expert."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colibrid.models.base import MAX_HEADS, ConfigReader, ExpertSource, Ops, WeightSource
from colibrid.models.common import TrunkArgs, moe_layers, read_moe, read_trunk
from colibrid.models.layers.gqa import GQAAttention, GQAShape
from colibrid.models.layers.rope import Rotary
from colibrid.models.transformer import MoEArgs, Transformer, load_decoder_layer

# transformers' Glm4MoeConfig silently defaults partial_rotary_factor to 0.5.
DEFAULT_PARTIAL_ROTARY = 0.5


@dataclass(frozen=True)
class ModelArgs:
    trunk: TrunkArgs
    moe: MoEArgs
    is_moe: tuple[bool, ...]
    attention: GQAShape
    rope: dict[str, Any]
    rotary_dim: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        r = ConfigReader(config, "glm4_moe")
        trunk = read_trunk(r)
        heads = r.int("num_attention_heads", hi=MAX_HEADS)
        kv_heads = r.int("num_key_value_heads", heads, hi=heads)
        if heads % kv_heads:
            raise r._fail("num_key_value_heads", f"= {kv_heads} does not divide {heads} heads")
        head_dim = r.int("head_dim", trunk.hidden_size // heads)
        rope = r.rope()
        partial = rope.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)
        if (
            isinstance(partial, bool)
            or not isinstance(partial, (int, float))
            or not 0 < partial <= 1
        ):
            raise r._fail("partial_rotary_factor", f"= {partial!r} must be in (0, 1]")
        rotary_dim = int(head_dim * partial)
        attention = GQAShape(
            hidden=trunk.hidden_size,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            bias=r.bool("attention_bias", False),
            qk_norm=r.bool("use_qk_norm", False),
            eps=trunk.rms_norm_eps,
        )
        return cls(
            trunk=trunk,
            moe=read_moe(r),
            is_moe=tuple(moe_layers(r, trunk.num_hidden_layers, 1)),
            attention=attention,
            rope=rope,
            rotary_dim=rotary_dim,
        )

    def attention_at(self, src: WeightSource, ops: Ops, layer: int) -> GQAAttention:
        return GQAAttention(src, ops, f"model.layers.{layer}.self_attn", self.attention)


def build(args: ModelArgs, src: WeightSource, experts: ExpertSource, ops: Ops) -> Transformer:
    t = args.trunk
    layers = [
        load_decoder_layer(
            src,
            ops,
            experts,
            layer,
            args.attention_at(src, ops, layer),
            hidden=t.hidden_size,
            eps=t.rms_norm_eps,
            moe=args.moe if args.is_moe[layer] else None,
            dense_width=t.intermediate_size,
        )
        for layer in range(t.num_hidden_layers)
    ]
    rotary = Rotary(args.rotary_dim, args.rope, max_positions=t.max_position_embeddings)
    return Transformer(
        src,
        ops,
        vocab=t.vocab_size,
        hidden=t.hidden_size,
        eps=t.rms_norm_eps,
        layers=layers,
        rotary=rotary,
        tie_embeddings=t.tie_word_embeddings,
    )
