"""Attention with sinks (gpt-oss): each query head has a learned logit that joins the
softmax's denominator and attends to nothing, so a head can put weight "nowhere".

This is the rule in numpy, one row at a time over exactly the keys it can see: the
reference the backends' `Ops.attend_gqa(..., sinks=)` are held to (the native kernel adds
the sink to the row's maximum and, after the keys, to its sum; MLX the same in a graph).

Shape legend: S new rows (positions start..start+S-1), T cached keys, H query heads,
G KV heads, d head dim.
"""

from __future__ import annotations

import numpy as np


def attend_with_sinks(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    sinks: np.ndarray,
    scale: float,
    start: int,
    window: int | None = None,
) -> np.ndarray:
    """Causal attention of q [S, H, d] over keys/values [T, G, d] with a sink logit per head
    (sinks [H]); query head h reads KV head h // (H / G); with ``window`` the row at position
    p sees keys t > p - window only. As transformers' gpt-oss eager attention: the scaled
    scores and the sink share one softmax (maximum subtracted, exp, normalised), the sink's
    share is dropped. Returns [S, H * d]."""
    rows, heads, d = q.shape
    groups = keys.shape[1]
    per_group = heads // groups
    sink = sinks.astype(np.float32).reshape(groups, per_group, 1)  # [G, H/G, 1]
    out = np.empty((rows, groups, per_group, d), dtype=np.float32)
    qg = q.reshape(rows, groups, per_group, d)
    for i in range(rows):
        p = start + i
        lo = 0 if window is None else max(0, p - window + 1)
        k = keys[lo : p + 1].transpose(1, 2, 0)  # [G, d, t]
        v = values[lo : p + 1].transpose(1, 0, 2)  # [G, t, d]
        scores = np.matmul(qg[i], k) * np.float32(scale)  # [G, H/G, t]
        top = np.maximum(scores.max(axis=-1, keepdims=True), sink)
        weights = np.exp(scores - top)
        total = weights.sum(axis=-1, keepdims=True, dtype=np.float32) + np.exp(sink - top)
        out[i] = np.matmul(weights / total, v)  # [G, H/G, d]
    return out.reshape(rows, heads * d)
