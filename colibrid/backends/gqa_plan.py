"""`Ops.gqa_attention` as a sequence of the other ops: the definition every backend's
block must match bit for bit, and what a backend without a fused block (cuda) runs.

It sits with the backends, for the reason backends.moe_plan does: a backend implements
it, and backends never import the models.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colibrid.backends.base import GQAWeights, KernelFamily


def gqa_attention_each(
    ops: Any,
    block: GQAWeights,
    rope: tuple[np.ndarray, np.ndarray],
    x: np.ndarray,
    caches: tuple[np.ndarray, np.ndarray],
    start: int,
    scale: float,
    family: KernelFamily,
) -> np.ndarray:
    """`Ops.gqa_attention` one op at a time: the definition a backend's block must match."""
    keys, values = caches
    rows, kv_heads, head_dim = x.shape[0], keys.shape[1], keys.shape[2]
    q, k, v = ops.matmul_many([block.q, block.k, block.v], x, family)
    if block.biases is not None:
        for y, b in zip((q, k, v), block.biases, strict=True):
            y += b
    if block.qk_norm is not None and block.qk_norm_whole:  # each row's whole projection
        q = ops.rms_norm(q, block.qk_norm[0], block.eps)
        k = ops.rms_norm(k, block.qk_norm[1], block.eps)
    q = q.reshape(rows, -1, head_dim)
    k = k.reshape(rows, kv_heads, head_dim)
    v = v.reshape(rows, kv_heads, head_dim)
    if block.qk_norm is not None and not block.qk_norm_whole:  # each head
        q = ops.rms_norm(q, block.qk_norm[0], block.eps)
        k = ops.rms_norm(k, block.qk_norm[1], block.eps)
    cos, sin = rope
    q = ops.rope_half(q, cos, sin)
    keys[start : start + rows] = ops.rope_half(k, cos, sin)
    values[start : start + rows] = v
    end = start + rows
    out = ops.attend_gqa(
        q, keys[:end], values[:end], scale, start, block.window, block.sinks
    )  # [S, H * d]
    return ops.matmul(block.o, out, family)
