"""Scaled dot-product attention over cached keys with a causal (and optional sparse) mask.

Shape legend: H heads, S new rows (absolute positions start..start+S-1), T cached keys.
"""

from __future__ import annotations

import numpy as np


def causal_mask(start: int, rows: int, keys: int, window: int | None = None) -> np.ndarray:
    """bool [S, T]: row i may see key t iff t <= start + i (and, with a sliding window,
    t > start + i - window)."""
    t = np.arange(keys)[None, :]
    position = (start + np.arange(rows))[:, None]
    allowed = t <= position
    if window is not None:
        allowed &= t > position - window
    return allowed


# What a key outside the mask scores: exp(EXCLUDED - max) underflows to exactly 0, as
# exp(-inf) would, but stays finite: numpy's vectorised exp leaves its fast path for
# vectors holding an infinity (a causal prefill was 8x slower in exp alone), and the fast
# path is what decode rows, which mask nothing, take anyway.
EXCLUDED = np.float32(-1e30)


def masked_softmax(scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of float32 scores [H, S, T], keys outside `allowed` [S, T]
    excluded (every row allows at least one key).

    Computed in place: `scores` (a temporary of the caller's) becomes the probabilities.
    A prefill's scores are hundreds of MB, and fresh pages cost a fault each on first touch
    (several µs in a VM): one new array per step made the softmax 5x slower than its
    arithmetic.
    """
    if not allowed.all():
        np.copyto(scores, EXCLUDED, where=~allowed[None, :, :])
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True, dtype=np.float32)
    return scores


def row_softmax(scores: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    """Softmax over the last axis of one query row's float32 scores [H, t] (its t visible
    keys, nothing past them), keys outside `keep` [t] excluded; in place.

    A row computed this way is the same arithmetic whatever else shares the pass: decode
    (one row), a speculative verify or a prefill (many) give it the same bits, because
    neither the reductions nor the products ever see keys the row cannot see.
    """
    if keep is not None and not keep.all():
        np.copyto(scores, EXCLUDED, where=~keep[None, :])
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True, dtype=np.float32)
    return scores
