"""GLM-4.5 / 4.6 / 4.7 (including Air): GQA with partial rotate_half RoPE, optional qk-norm
and attention bias, one dense first layer, then sigmoid-routed MoE with a shared expert."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colibrid.models import gqa_model
from colibrid.models.base import ConfigReader
from colibrid.models.common import moe_layers, read_moe, read_trunk
from colibrid.models.gqa_model import GQAModelArgs, read_heads
from colibrid.models.layers.gqa import GQAShape

# transformers' Glm4MoeConfig silently defaults partial_rotary_factor to 0.5.
DEFAULT_PARTIAL_ROTARY = 0.5

build = gqa_model.build


@dataclass(frozen=True)
class ModelArgs(GQAModelArgs):
    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        r = ConfigReader(config, "glm4_moe")
        trunk = read_trunk(r)
        h = read_heads(r, trunk.hidden_size)
        rope = r.rope()
        partial = rope.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)
        if (
            isinstance(partial, bool)
            or not isinstance(partial, (int, float))
            or not 0 < partial <= 1
        ):
            raise r._fail("partial_rotary_factor", f"= {partial!r} must be in (0, 1]")
        rotary_dim = int(h.head_dim * partial)
        attention = GQAShape(
            hidden=trunk.hidden_size,
            heads=h.heads,
            kv_heads=h.kv_heads,
            head_dim=h.head_dim,
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
