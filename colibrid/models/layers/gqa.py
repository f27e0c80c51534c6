"""Grouped-query attention (GLM-4.x): q/k/v projections with optional bias, optional per-head
qk RMSNorm, partial rotate_half RoPE, KV cached per KV head.

Shape legend: S new rows, T cached keys, H query heads, G KV heads, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibrid.models.base import Linear, Ops, Step, WeightSource


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
        self.ops = ops
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
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = self.ops.matmul_many([p.weight for p in projections], x, step.family)
        if s.bias:
            for y, p in zip((q, k, v), projections, strict=True):
                y += p.bias
        q = q.reshape(rows, s.heads, s.head_dim)
        k = k.reshape(rows, s.kv_heads, s.head_dim)
        v = v.reshape(rows, s.kv_heads, s.head_dim)
        if self.q_norm is not None:
            q = self.ops.rms_norm(q, self.q_norm, s.eps)
            k = self.ops.rms_norm(k, self.k_norm, s.eps)
        cos, sin = rope
        q = self.ops.rope_half(q, cos, sin)
        k = self.ops.rope_half(k, cos, sin)
        keys = cache.write(layer, "k", k)  # [T, G, d]
        values = cache.write(layer, "v", v)  # [T, G, d]
        out = self.ops.attend_gqa(q, keys, values, self.scale, step.start)  # [S, H * d]
        return self.o_proj(out, step.family), None
