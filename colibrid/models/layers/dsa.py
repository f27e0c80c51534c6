"""The DSA lightning indexer (DeepSeek-V3.2, GLM-5.x): which cached keys each query may
attend to.

Per "full" layer: index queries from the q-LoRA residual (`wq_b`), one index key per token
(`wk`, then LayerNorm), RoPE on the first R dims of both, and a score per key
    score(t) = sum_h w_h * ReLU(q_h . k_t / sqrt(d_idx)),   w = weights_proj(x) / sqrt(H_idx)
Each query keeps its `index_topk` best causal keys; below that many keys it keeps all of
them, which is exactly dense attention. "Shared" layers reuse the selection of the previous
full layer. colibrid/models/NUMERICS.md walks through it with the shapes.

The two families run this same code and differ in one place, the RoPE layout of the index
queries and keys (`IndexerShape.interleave`): DeepSeek-V3.2 rotates them in the rotate_half
layout although its MLA is interleaved, GLM-5 interleaves both (as transformers'
DeepseekV32Indexer and GlmMoeDsaIndexer do). The layout changes the scores, hence the keys
kept, so it is a field of the shape and not a constant.

Ties go to the earlier position, and this is a choice, not a detail: a key that every index
head scores below zero scores exactly 0 after the ReLU, so ties at the top-k cut are common
(few index heads, a negative head weight). `torch.topk` leaves the tie order unspecified and on
CPU it depends on the row length, so transformers' cached decode and its full forward pick
different tied keys (issue 13). A rule that looks only at (score, position) makes a row's
selection independent of how many later keys exist, which keeps decode equal to prefill.

Shape legend: S new rows, T cached keys, Hi index heads, Di index head dim, R rope dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibrid.models.base import Linear, Ops, Step, WeightSource
from colibrid.models.layers.norm import layer_norm
from colibrid.models.layers.rope import apply_half, apply_interleave

INDEX_NORM_EPS = 1e-6


def indexer_prefix(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.indexer"


@dataclass(frozen=True)
class IndexerShape:
    hidden: int
    q_lora_rank: int
    heads: int
    head_dim: int
    rope: int
    topk: int
    interleave: bool  # RoPE layout of the index q/k: pairs (GLM-5) or rotate_half (V3.2)

    def cache_layout(self) -> dict[str, tuple[int, ...]]:
        """What one position adds to its layer's cache: the indexer's key."""
        return {"index_k": (self.head_dim,)}


class Indexer:
    def __init__(self, src: WeightSource, ops: Ops, prefix: str, shape: IndexerShape) -> None:
        s = shape
        self.shape = s
        self.wq_b = Linear.load(src, ops, f"{prefix}.wq_b", s.heads * s.head_dim, s.q_lora_rank)
        self.wk = Linear.load(src, ops, f"{prefix}.wk", s.head_dim, s.hidden)
        self.k_norm_w = src.vector(f"{prefix}.k_norm.weight", (s.head_dim,))
        self.k_norm_b = src.vector(f"{prefix}.k_norm.bias", (s.head_dim,))
        self.weights_proj = Linear.load(src, ops, f"{prefix}.weights_proj", s.heads, s.hidden)
        self.softmax_scale = np.float32(s.head_dim**-0.5)
        self.head_scale = np.float32(s.heads**-0.5)
        self._rotate = apply_interleave if s.interleave else apply_half

    def cache_layout(self) -> dict[str, tuple[int, ...]]:
        return self.shape.cache_layout()

    def __call__(
        self,
        x: np.ndarray,
        q_resid: np.ndarray,
        layer: int,
        cache,
        step: Step,
        rope: tuple[np.ndarray, np.ndarray],
    ) -> np.ndarray:
        """bool [S, T]: the keys each new row keeps; row i (position start + i) keeps only
        causal keys, t <= start + i, and is scored over exactly those, on its own, so it
        selects the same keys in a decode step, a verify or a prefill."""
        s = self.shape
        rows = x.shape[0]
        cos, sin = rope
        q = self.wq_b(q_resid, step.family).reshape(rows, s.heads, s.head_dim)
        q = np.concatenate([self._rotate(q[..., : s.rope], cos, sin), q[..., s.rope :]], -1)
        k = layer_norm(self.wk(x, step.family), self.k_norm_w, self.k_norm_b, INDEX_NORM_EPS)
        k = np.concatenate(
            [self._rotate(k[:, None, : s.rope], cos, sin)[:, 0], k[:, s.rope :]], axis=-1
        )
        keys = cache.write(layer, "index_k", k)  # [T, Di]
        weights = self.weights_proj(x, step.family) * self.head_scale  # [S, Hi]
        keep = np.zeros((rows, keys.shape[0]), dtype=bool)
        for i in range(rows):
            t = step.start + i + 1
            if t <= s.topk:  # no more keys than the budget: every causal key, i.e. dense
                keep[i, :t] = True
                continue
            scores = np.matmul(q[i], keys[:t].T) * self.softmax_scale  # [Hi, t]
            np.maximum(scores, 0, out=scores)
            keep[i, top_keys(np.matmul(weights[i], scores), s.topk)] = True  # [t] scores
        return keep


def top_keys(index_scores: np.ndarray, topk: int) -> np.ndarray:
    """The positions of the `topk` best of a row's index scores [t]; among equal scores the
    earlier position wins (a stable sort), whatever the row's length."""
    return np.argsort(-index_scores, kind="stable")[:topk]
