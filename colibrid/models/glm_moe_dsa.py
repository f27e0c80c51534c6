"""GLM-5.x: DeepSeek-V3's MLA and MoE plus the DSA lightning indexer, which keeps each
query's top `index_topk` keys once the context exceeds it. Layers marked "shared" in
`indexer_types` reuse the previous full layer's selection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colibrid.models import deepseek_v3
from colibrid.models.base import ConfigReader, Ops, WeightSource
from colibrid.models.common import TrunkArgs
from colibrid.models.layers.dsa import Indexer, IndexerShape
from colibrid.models.layers.mla import MLAShape

ARCH = "glm_moe_dsa"
build = deepseek_v3.build


@dataclass(frozen=True)
class ModelArgs(deepseek_v3.ModelArgs):
    indexer: IndexerShape | None
    indexer_types: tuple[str, ...]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        r = ConfigReader(config, ARCH)
        # always interleaved: a `rope_interleave` key is ignored, as transformers ignores it
        fields = deepseek_v3.read_mla_fields(r, default_dense=3, interleave=True)
        trunk: TrunkArgs = fields["trunk"]
        attention: MLAShape = fields["attention"]
        if attention.q_lora_rank is None:
            raise r._fail("q_lora_rank", "is required by the DSA indexer")
        shape = IndexerShape(
            hidden=trunk.hidden_size,
            q_lora_rank=attention.q_lora_rank,
            heads=r.int("index_n_heads", 32),
            head_dim=r.int("index_head_dim", 128),
            rope=attention.rope,
            topk=r.int("index_topk", 2048, hi=1 << 30),
        )
        if shape.head_dim < shape.rope:
            raise r._fail("index_head_dim", f"= {shape.head_dim} is below qk_rope_head_dim")
        return cls(
            **fields, indexer=shape, indexer_types=tuple(_indexer_types(r, trunk.num_hidden_layers))
        )

    def indexer_at(self, src: WeightSource, ops: Ops, layer: int) -> Indexer | None:
        prefix = f"model.layers.{layer}.self_attn.indexer"
        if layer < len(self.indexer_types) and self.indexer_types[layer] == "shared":
            return None
        if layer >= len(self.indexer_types) and not src.has(f"{prefix}.wk.weight"):
            return None  # an MTP layer without indexer weights
        return Indexer(src, ops, prefix, self.indexer)


def _indexer_types(r: ConfigReader, n_layers: int) -> list[str]:
    """Per-layer "full"/"shared", as transformers derives it when the config omits it."""
    kinds = r.str_list("indexer_types", n_layers, {"full", "shared"})
    if kinds is None:
        pattern = r.config.get("index_topk_pattern")
        if isinstance(pattern, str):
            kinds = [{"F": "full", "S": "shared"}.get(c, "?") for c in pattern[:n_layers]]
        elif isinstance(pattern, list):
            kinds = list(pattern[:n_layers])
        else:
            freq = max(r.int("index_topk_freq", 1, hi=1024), 1)
            offset = r.int("index_skip_topk_offset", 2, lo=0, hi=1024)
            kinds = [
                "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)
            ]
    if len(kinds) < n_layers or any(k not in ("full", "shared") for k in kinds):
        raise r._fail("index_topk_pattern", "must give 'full'/'shared' (F/S) for every layer")
    if kinds and kinds[0] == "shared":
        raise r._fail("indexer_types", "layer 0 cannot reuse a previous layer's selection")
    return kinds
