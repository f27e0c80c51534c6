"""DeepSeek-V3: MLA (interleaved RoPE by default) with the latent KV cache, dense first
layers, group-limited sigmoid routing (n_group 8 / topk_group 4 on the real model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colibrid.models.base import MAX_HEADS, ConfigReader, ExpertSource, Ops, WeightSource
from colibrid.models.common import TrunkArgs, moe_layers, read_moe, read_trunk
from colibrid.models.layers.dsa import Indexer, IndexerShape, indexer_prefix
from colibrid.models.layers.mla import MLAAttention, MLAShape, softmax_scale
from colibrid.models.mtp import MTPLayer
from colibrid.models.transformer import (
    MoEArgs,
    Transformer,
    build_transformer,
    load_decoder_layer,
)

ARCH = "deepseek_v3"


@dataclass(frozen=True)
class ModelArgs:
    trunk: TrunkArgs
    moe: MoEArgs
    is_moe: tuple[bool, ...]
    attention: MLAShape
    rope: dict[str, Any]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return cls(**read_mla_fields(ConfigReader(config, ARCH), default_dense=3, interleave=None))

    def attention_at(self, src: WeightSource, ops: Ops, layer: int) -> MLAAttention:
        return MLAAttention(
            src,
            ops,
            f"model.layers.{layer}.self_attn",
            self.attention,
            softmax_scale(self.attention, self.rope),
            self.indexer_at(src, ops, layer),
        )

    def cache_layout_at(self, src: WeightSource, layer: int) -> dict[str, tuple[int, ...]]:
        """What layer ``layer`` caches per position, from the config and the checkpoint's
        names alone (before any weight is loaded)."""
        return self.attention.cache_layout(self.indexer_shape_at(src, layer))

    def indexer_shape_at(self, src: WeightSource, layer: int) -> IndexerShape | None:
        """The DSA indexer layer ``layer`` runs, or None (DeepSeek-V3 has none)."""
        return None

    def indexer_at(self, src: WeightSource, ops: Ops, layer: int) -> Indexer | None:
        shape = self.indexer_shape_at(src, layer)
        return None if shape is None else Indexer(src, ops, indexer_prefix(layer), shape)


def read_mla_fields(
    r: ConfigReader, *, default_dense: int, interleave: bool | None
) -> dict[str, Any]:
    """Trunk, MoE and MLA fields. `interleave=None` reads `rope_interleave` (default True) as
    transformers' DeepSeek-V3 does; a bool fixes the RoPE layout whatever the config says
    (the DSA families: transformers' deepseek_v32 and glm_moe_dsa always interleave and
    ignore `rope_interleave`)."""
    trunk = read_trunk(r)
    if interleave is None:
        interleave = r.bool("rope_interleave", True)
    q_lora = r.optional_int("q_lora_rank")
    attention = MLAShape(
        hidden=trunk.hidden_size,
        heads=r.int("num_attention_heads", hi=MAX_HEADS),
        q_lora_rank=q_lora,
        kv_lora_rank=r.int("kv_lora_rank"),
        nope=r.int("qk_nope_head_dim"),
        rope=r.int("qk_rope_head_dim"),
        v=r.int("v_head_dim"),
        bias=r.bool("attention_bias", False),
        interleave=interleave,
    )
    if attention.rope % 2:
        raise r._fail("qk_rope_head_dim", "must be even")
    return dict(
        trunk=trunk,
        moe=read_moe(r),
        is_moe=tuple(moe_layers(r, trunk.num_hidden_layers, default_dense)),
        attention=attention,
        rope=r.rope(),
    )


def build(args: Any, src: WeightSource, experts: ExpertSource, ops: Ops) -> Transformer:
    """Shared by deepseek_v3, deepseek_v32 and glm_moe_dsa (whose args add the DSA indexer)."""
    model = build_transformer(args, src, experts, ops, args.attention.rope)
    model.mtp = load_mtp(args, src, experts, ops)
    return model


def load_mtp(args: Any, src: WeightSource, experts: ExpertSource, ops: Ops) -> MTPLayer | None:
    """The MTP layer at index num_hidden_layers, when the config declares it and it is there."""
    t = args.trunk
    index = t.num_hidden_layers
    if t.num_mtp_layers == 0 or not MTPLayer.present(src, index):
        return None
    decoder = load_decoder_layer(
        src,
        ops,
        experts,
        index,
        args.attention_at(src, ops, index),
        hidden=t.hidden_size,
        eps=t.rms_norm_eps,
        moe=args.moe,
        dense_width=t.intermediate_size,
    )
    return MTPLayer(src, ops, index, t.hidden_size, t.rms_norm_eps, decoder)
