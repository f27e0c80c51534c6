"""Grouped-query attention (GLM-4.x): q/k/v projections with optional bias, optional per-head
qk RMSNorm, partial rotate_half RoPE, KV cached per KV head.

Shape legend: S new rows, T cached keys, H query heads, G KV heads, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibrid.models.base import Linear, Ops, Step, WeightSource
from colibrid.models.layers.attention import causal_mask, masked_softmax
from colibrid.models.layers.norm import rms_norm
from colibrid.models.layers.rope import apply_half


@dataclass(frozen=True)
class GQAShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    bias: bool
    qk_norm: bool
    eps: float


class GQAAttention:
    def __init__(self, src: WeightSource, ops: Ops, prefix: str, shape: GQAShape) -> None:
        s = shape
        self.shape = s
        self.q_proj = Linear.load(
            src, ops, f"{prefix}.q_proj", s.heads * s.head_dim, s.hidden, bias=s.bias
        )
        self.k_proj = Linear.load(
            src, ops, f"{prefix}.k_proj", s.kv_heads * s.head_dim, s.hidden, bias=s.bias
        )
        self.v_proj = Linear.load(
            src, ops, f"{prefix}.v_proj", s.kv_heads * s.head_dim, s.hidden, bias=s.bias
        )
        self.o_proj = Linear.load(src, ops, f"{prefix}.o_proj", s.hidden, s.heads * s.head_dim)
        self.q_norm = self.k_norm = None
        if s.qk_norm:
            self.q_norm = src.vector(f"{prefix}.q_norm.weight", (s.head_dim,))
            self.k_norm = src.vector(f"{prefix}.k_norm.weight", (s.head_dim,))
        self.scale = np.float32(s.head_dim**-0.5)

    def cache_layout(self) -> dict[str, tuple[int, ...]]:
        return {
            "k": (self.shape.kv_heads, self.shape.head_dim),
            "v": (self.shape.kv_heads, self.shape.head_dim),
        }

    def __call__(
        self,
        x: np.ndarray,
        layer: int,
        cache,
        step: Step,
        rope: tuple[np.ndarray, np.ndarray],
        selection: np.ndarray | None = None,
    ) -> tuple[np.ndarray, None]:
        """Returns the attention output [S, D]; GQA has no sparse key selection."""
        s = self.shape
        rows = x.shape[0]
        q = self.q_proj(x, step.family).reshape(rows, s.heads, s.head_dim)
        k = self.k_proj(x, step.family).reshape(rows, s.kv_heads, s.head_dim)
        v = self.v_proj(x, step.family).reshape(rows, s.kv_heads, s.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, s.eps)
            k = rms_norm(k, self.k_norm, s.eps)
        cos, sin = rope
        q = apply_half(q, cos, sin)
        k = apply_half(k, cos, sin)
        keys = cache.write(layer, "k", k)  # [T, G, d]
        values = cache.write(layer, "v", v)  # [T, G, d]
        out = grouped_attention(q, keys, values, self.scale, step.start)  # [S, H * d]
        return self.o_proj(out, step.family), None


def grouped_attention(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: np.float32, start: int
) -> np.ndarray:
    """Causal attention of q [S, H, d] over keys and values [T, G, d]; returns [S, H * d].

    Query head h reads KV head h // (H / G) (transformers' `repeat_kv`). The H / G query
    heads of a KV head are stacked as rows of one matmul against that head's keys, read
    where the cache holds them: no per-step copy of the cache repeated H / G times (that
    copy grew with the context and was a quarter of decode time on the demo).
    """
    rows, heads, d = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    q_g = q.transpose(1, 0, 2).reshape(kv_heads, group * rows, d)  # [G, group * S, d]
    scores = np.matmul(q_g, keys.transpose(1, 2, 0))  # [G, group * S, T]
    scores *= scale
    scores = scores.reshape(heads, rows, keys.shape[0])  # [H, S, T]
    probs = masked_softmax(scores, causal_mask(start, rows, keys.shape[0]))
    out = np.matmul(probs.reshape(kv_heads, group * rows, -1), values.transpose(1, 0, 2))
    return np.ascontiguousarray(out.reshape(heads, rows, d).transpose(1, 0, 2)).reshape(
        rows, heads * d
    )
