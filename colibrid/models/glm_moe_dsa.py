"""GLM-5.x: DeepSeek-V3.2 (MLA, MoE, the DSA lightning indexer) with the indexer's RoPE
interleaved and cross-layer sharing: layers marked "shared" in `indexer_types` reuse the
previous full layer's selection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colibrid.models import deepseek_v32
from colibrid.models.base import ConfigReader, WeightSource
from colibrid.models.layers.dsa import IndexerShape

ARCH = "glm_moe_dsa"
build = deepseek_v32.build


@dataclass(frozen=True)
class ModelArgs(deepseek_v32.ModelArgs):
    indexer_types: tuple[str, ...]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        r = ConfigReader(config, ARCH)
        # the indexer interleaves its RoPE like the MLA (DeepSeek-V3.2's uses rotate_half)
        fields = deepseek_v32.read_dsa_fields(r, default_index_heads=32, index_interleave=True)
        n_layers = fields["trunk"].num_hidden_layers
        return cls(**fields, indexer_types=tuple(_indexer_types(r, n_layers)))

    def indexer_shape_at(self, src: WeightSource, layer: int) -> IndexerShape | None:
        if layer < len(self.indexer_types) and self.indexer_types[layer] == "shared":
            return None
        return super().indexer_shape_at(src, layer)


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
