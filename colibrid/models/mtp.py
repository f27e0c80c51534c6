"""The multi-token-prediction (MTP) layer that DeepSeek-V3 and GLM-5.x checkpoints carry.

transformers skips these weights; colibri loads them so speculation can use them. The
layer sits at index `num_hidden_layers` with the usual decoder tensors plus `eh_proj`
[D, 2D] applied to concat(enorm(embed(next token)), hnorm(final-normed hidden)), and
`shared_head.norm` before the main LM head.
"""

from __future__ import annotations

import numpy as np

from colibrid.backends.base import KernelFamily
from colibrid.models.base import Linear, Ops, WeightSource
from colibrid.models.transformer import DecoderLayer


class MTPLayer:
    def __init__(
        self,
        src: WeightSource,
        ops: Ops,
        index: int,
        hidden: int,
        eps: float,
        decoder: DecoderLayer,
    ) -> None:
        prefix = f"model.layers.{index}"
        self.index = index
        self.ops = ops
        self.eps = eps
        self.eh_proj = Linear.load(src, ops, f"{prefix}.eh_proj", hidden, 2 * hidden)
        self.enorm = src.vector(f"{prefix}.enorm.weight", (hidden,))
        self.hnorm = src.vector(f"{prefix}.hnorm.weight", (hidden,))
        self.head_norm = src.vector(f"{prefix}.shared_head.norm.weight", (hidden,))
        self.decoder = decoder

    @staticmethod
    def present(src: WeightSource, index: int) -> bool:
        return src.has(f"model.layers.{index}.eh_proj.weight")

    def input(self, embedded: np.ndarray, hidden: np.ndarray, family: KernelFamily) -> np.ndarray:
        """The MTP decoder input [S, D] from next-token embeddings and main hidden states."""
        joined = np.concatenate(
            [
                self.ops.rms_norm(embedded, self.enorm, self.eps),
                self.ops.rms_norm(hidden, self.hnorm, self.eps),
            ],
            axis=-1,
        )
        return self.eh_proj(np.ascontiguousarray(joined), family)
