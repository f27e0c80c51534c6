"""The multi-token-prediction (MTP) layer that DeepSeek-V3 and GLM-5.x checkpoints carry.

transformers skips these weights; colibri loads them so speculation can use them. The
layer sits at index `num_hidden_layers` with the usual decoder tensors plus `eh_proj`
[D, 2D] applied to concat(enorm(embed(next token)), hnorm(final-normed hidden)), and
`shared_head.norm` before the main LM head.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colibrid.backends.base import KernelFamily
from colibrid.models.base import Linear, Ops, Segment, Step, WeightSource
from colibrid.models.transformer import DecoderLayer, Transformer


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

    def cache_layout(self) -> dict[str, tuple[int, ...]]:
        return self.decoder.attention.cache_layout()

    def draft_hidden(
        self,
        model: Transformer,
        next_tokens: np.ndarray,
        hidden: np.ndarray,
        positions: np.ndarray,
        cache: Any,
        family: KernelFamily,
    ) -> np.ndarray:
        """The MTP layer on rows (the token after position p, the hidden state at p) for
        the given positions: appended to `cache` (its own KV cache, one layer) after what
        it holds; returns the head-normed hidden states [S, D] the LM head turns into the
        guesses for the tokens after those."""
        x = self.input(self.ops.embed(model.embed_tokens, next_tokens), hidden, family)
        segment = Segment(cache, Step(cache.length, family), len(x))
        out = self.decoder(x, 0, [segment], model.rotary.tables(positions), [None])
        return self.ops.rms_norm(out, self.head_norm, self.eps)

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
