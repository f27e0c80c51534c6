"""Grouped-query attention (GLM-4.x, Qwen3-MoE, Mixtral, OLMoE, gpt-oss): q/k/v projections
with optional bias, optional qk RMSNorm (per head, or over the whole projection as OLMoE has
it), partial rotate_half RoPE, an optional sliding window, optional attention sinks
(gpt-oss), KV cached per KV head.

Shape legend: S new rows, T cached keys, H query heads, G KV heads, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibrid.backends.base import GQAWeights
from colibrid.models.base import Linear, Ops, Step, WeightSource


@dataclass(frozen=True)
class GQAShape:
    """A GQA block's shape and options. ``bias``: q/k/v biases; ``o_bias``: an o_proj bias
    too (Qwen3-MoE and OLMoE put one on every projection, GLM-4.x never on o_proj);
    ``qk_norm_whole``: the qk norms span the whole projection (OLMoE) rather than a head;
    ``window``: a sliding window of keys (Mixtral; Qwen3-MoE with `use_sliding_window`;
    gpt-oss's sliding layers), None for every causal key; ``sinks``: a learned logit per
    query head joins each softmax's denominator (gpt-oss, ``self_attn.sinks`` [H])."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    bias: bool
    qk_norm: bool
    eps: float
    o_bias: bool = False
    qk_norm_whole: bool = False
    window: int | None = None
    sinks: bool = False

    def cache_layout(self) -> dict[str, tuple[int, ...]]:
        """What one position caches: keys and values per KV head."""
        return {"k": (self.kv_heads, self.head_dim), "v": (self.kv_heads, self.head_dim)}


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
        self.o_proj = Linear.load(
            src, ops, f"{prefix}.o_proj", s.hidden, s.heads * s.head_dim, bias=s.o_bias
        )
        self.q_norm = self.k_norm = None
        if s.qk_norm:
            q_span = s.heads * s.head_dim if s.qk_norm_whole else s.head_dim
            k_span = s.kv_heads * s.head_dim if s.qk_norm_whole else s.head_dim
            self.q_norm = src.vector(f"{prefix}.q_norm.weight", (q_span,))
            self.k_norm = src.vector(f"{prefix}.k_norm.weight", (k_span,))
        self.sinks = src.vector(f"{prefix}.sinks", (s.heads,)) if s.sinks else None
        self.scale = np.float32(s.head_dim**-0.5)
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.block = GQAWeights(
            self.q_proj.weight,
            self.k_proj.weight,
            self.v_proj.weight,
            self.o_proj.weight,
            biases=tuple(p.bias for p in projections) if s.bias else None,
            qk_norm=(self.q_norm, self.k_norm) if self.q_norm is not None else None,
            eps=s.eps,
            qk_norm_whole=s.qk_norm_whole,
            window=s.window,
            sinks=self.sinks,
        )

    def cache_layout(self) -> dict[str, tuple[int, ...]]:
        return self.shape.cache_layout()

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
        arrays = cache.arrays_for(layer, x.shape[0])
        out = self.ops.gqa_attention(
            self.block,
            rope,
            x,
            (arrays["k"], arrays["v"]),
            step.start,
            float(self.scale),
            step.family,
        )
        if self.o_proj.bias is not None:  # outside the block: added to its output as is
            out += self.o_proj.bias
        return out, None
