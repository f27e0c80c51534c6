"""Multi-head latent attention (DeepSeek-V3, GLM-5.x) with the compressed latent KV cache.

Per token and layer the cache holds the normalised latent c (kv_lora_rank floats) and the
rotary key r (qk_rope_head_dim floats): 512 + 64 = 576 floats on GLM-5, 57x less than
expanded keys and values. Attention uses weight absorption for every row count: W_k
(the key half of kv_b_proj) is folded into the query, scores are taken against the
latent directly, and the probability-weighted latent goes through W_v.

Each new row attends on its own, over exactly the keys it can see ([H, C] times [C, t]
for the row at position t - 1): so a row gets the same bits in a one-token decode, a
speculative verify of several drafts or a prefill, and a batch of requests computes for
each what it would alone. A batched [H, S, C] x [C, T] product would not: the reductions
over T and the BLAS blocking over S change with the rows that share the pass.

Shape legend: S new rows, T cached keys, H heads, C kv_lora_rank, N qk_nope_head_dim,
R qk_rope_head_dim, V v_head_dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibrid.models.base import Linear, Ops, Step, WeightSource
from colibrid.models.layers.absorb import split_kv_b
from colibrid.models.layers.attention import row_softmax
from colibrid.models.layers.dsa import Indexer, IndexerShape
from colibrid.models.layers.rope import apply_half, apply_interleave

# The reference builds q_a_layernorm / kv_a_layernorm with the default epsilon, not
# config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAShape:
    hidden: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    nope: int
    rope: int
    v: int
    bias: bool
    interleave: bool

    def cache_layout(self, indexer: IndexerShape | None) -> dict[str, tuple[int, ...]]:
        """What one position caches: the compressed latent and the rotary key, plus the
        indexer's key on a layer with its own DSA indexer."""
        layout: dict[str, tuple[int, ...]] = {
            "latent": (self.kv_lora_rank,),
            "k_rope": (self.rope,),
        }
        if indexer is not None:
            layout.update(indexer.cache_layout())
        return layout


def softmax_scale(shape: MLAShape, rope_params: dict[str, Any]) -> float:
    """1/sqrt(N+R), times mscale^2 under YaRN with mscale_all_dim (as the reference)."""
    scale = (shape.nope + shape.rope) ** -0.5
    if rope_params.get("rope_type", "default") != "default":
        mscale_all_dim = rope_params.get("mscale_all_dim") or 0
        factor = float(rope_params.get("factor") or 1.0)
        if mscale_all_dim and factor > 1:
            m = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
            scale *= m * m
    return scale


class MLAAttention:
    def __init__(
        self,
        src: WeightSource,
        ops: Ops,
        prefix: str,
        shape: MLAShape,
        scale: float,
        indexer: Indexer | None = None,
    ) -> None:
        s = shape
        self.shape = s
        qk = s.nope + s.rope
        if s.q_lora_rank is None:
            self.q_proj = Linear.load(src, ops, f"{prefix}.q_proj", s.heads * qk, s.hidden)
        else:
            self.q_a_proj = Linear.load(
                src, ops, f"{prefix}.q_a_proj", s.q_lora_rank, s.hidden, bias=s.bias
            )
            self.q_a_norm = src.vector(f"{prefix}.q_a_layernorm.weight", (s.q_lora_rank,))
            self.q_b_proj = Linear.load(src, ops, f"{prefix}.q_b_proj", s.heads * qk, s.q_lora_rank)
        self.kv_a_proj = Linear.load(
            src, ops, f"{prefix}.kv_a_proj_with_mqa", s.kv_lora_rank + s.rope, s.hidden, bias=s.bias
        )
        self.kv_a_norm = src.vector(f"{prefix}.kv_a_layernorm.weight", (s.kv_lora_rank,))
        kv_b = src.weight(f"{prefix}.kv_b_proj.weight", (s.heads * (s.nope + s.v), s.kv_lora_rank))
        self.absorb_k, self.w_v = split_kv_b(kv_b, s.heads, s.nope, s.v)  # W_v: [H * V, C]
        self.ops = ops
        self.o_proj = Linear.load(
            src, ops, f"{prefix}.o_proj", s.hidden, s.heads * s.v, bias=s.bias
        )
        self.scale = np.float32(scale)
        self.indexer = indexer
        self._rotate = apply_interleave if s.interleave else _apply_half_full

    def cache_layout(self) -> dict[str, tuple[int, ...]]:
        return self.shape.cache_layout(None if self.indexer is None else self.indexer.shape)

    def __call__(
        self,
        x: np.ndarray,
        layer: int,
        cache,
        step: Step,
        rope: tuple[np.ndarray, np.ndarray],
        selection: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Returns the attention output [S, D] and the DSA key selection [S, T] (or None)."""
        s = self.shape
        rows = x.shape[0]
        family = step.family
        if s.q_lora_rank is None:
            q_resid = None
            q = self.q_proj(x, family)
        else:
            q_resid = self.ops.rms_norm(self.q_a_proj(x, family), self.q_a_norm, LATENT_NORM_EPS)
            q = self.q_b_proj(q_resid, family)
        q = q.reshape(rows, s.heads, s.nope + s.rope)
        cos, sin = rope
        q_nope = q[..., : s.nope]  # [S, H, N]
        q_rope = self._rotate(q[..., s.nope :], cos, sin)  # [S, H, R]
        kv = self.kv_a_proj(x, family)  # [S, C + R]
        latent = self.ops.rms_norm(kv[:, : s.kv_lora_rank], self.kv_a_norm, LATENT_NORM_EPS)
        k_rope = self._rotate(kv[:, None, s.kv_lora_rank :], cos, sin)[:, 0, :]  # [S, R]
        latents = cache.write(layer, "latent", latent)  # [T, C]
        rope_keys = cache.write(layer, "k_rope", k_rope)  # [T, R]
        if self.indexer is not None:
            selection = self.indexer(x, q_resid, layer, cache, step, rope)
        # absorbed scores: q_nope W_k against the latent, plus the rotary part
        q_latent = self.absorb_k(self.ops, q_nope, family)  # [S, H, C]
        q_rope = np.ascontiguousarray(q_rope)
        o_latent = np.empty((rows, s.heads, s.kv_lora_rank), dtype=np.float32)
        for i in range(rows):  # each row alone, over its visible keys [0, t)
            t = step.start + i + 1
            scores = np.matmul(q_latent[i], latents[:t].T)  # [H, t]
            scores += np.matmul(q_rope[i], rope_keys[:t].T)
            scores *= self.scale
            keep = None if selection is None else selection[i, :t]
            o_latent[i] = np.matmul(row_softmax(scores, keep), latents[:t])  # [H, C]
        out = self.ops.matmul_blocks(self.w_v, o_latent, family)  # [S, H * V]
        return self.o_proj(out, family), selection


def _apply_half_full(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    return apply_half(x, cos, sin)
