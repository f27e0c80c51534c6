"""DeepSeek-V3.2: DeepSeek-V3's MLA and MoE plus the DSA lightning indexer on every layer,
which keeps each query's top `index_topk` keys once the context exceeds it.

GLM-5.x (`glm_moe_dsa`) is this model plus cross-layer sharing of the selection, and both
run the same indexer (layers/dsa.py) with one difference: V3.2 rotates the index queries and
keys in the rotate_half layout while its MLA stays interleaved; GLM-5 interleaves both. So
this module reads the fields both share and GLM-5 extends it, as transformers'
GlmMoeDsa classes extend DeepseekV32's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colibrid.models import deepseek_v3
from colibrid.models.base import ConfigReader, WeightSource
from colibrid.models.common import TrunkArgs
from colibrid.models.layers.dsa import IndexerShape, indexer_prefix
from colibrid.models.layers.mla import MLAShape

ARCH = "deepseek_v32"
build = deepseek_v3.build


@dataclass(frozen=True)
class ModelArgs(deepseek_v3.ModelArgs):
    indexer: IndexerShape

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        r = ConfigReader(config, ARCH)
        return cls(**read_dsa_fields(r, default_index_heads=64, index_interleave=False))

    def indexer_shape_at(self, src: WeightSource, layer: int) -> IndexerShape | None:
        prefix = indexer_prefix(layer)
        if layer >= self.trunk.num_hidden_layers and not src.has(f"{prefix}.wk.weight"):
            return None  # an MTP layer without indexer weights
        return self.indexer


def read_dsa_fields(
    r: ConfigReader, *, default_index_heads: int, index_interleave: bool
) -> dict[str, Any]:
    """DeepSeek-V3's fields with the MLA RoPE always interleaved (transformers' DSA models
    have no `rope_interleave` switch and ignore the key), plus the indexer's shape.
    `default_index_heads` is the family's `index_n_heads` default (V3.2 64, GLM-5 32);
    `index_interleave` the indexer's RoPE layout, which the config does not name."""
    fields = deepseek_v3.read_mla_fields(r, default_dense=3, interleave=True)
    trunk: TrunkArgs = fields["trunk"]
    attention: MLAShape = fields["attention"]
    if attention.q_lora_rank is None:
        raise r._fail("q_lora_rank", "is required by the DSA indexer")
    shape = IndexerShape(
        hidden=trunk.hidden_size,
        q_lora_rank=attention.q_lora_rank,
        heads=r.int("index_n_heads", default_index_heads),
        head_dim=r.int("index_head_dim", 128),
        rope=attention.rope,
        topk=r.int("index_topk", 2048, hi=1 << 30),
        interleave=index_interleave,
    )
    if shape.head_dim < shape.rope:
        raise r._fail("index_head_dim", f"= {shape.head_dim} is below qk_rope_head_dim")
    return dict(fields, indexer=shape)
