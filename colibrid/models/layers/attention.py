"""Scaled dot-product attention over cached keys with a causal (and optional sparse) mask.

Shape legend: H heads, S new rows (absolute positions start..start+S-1), T cached keys.
"""

from __future__ import annotations

import numpy as np


def causal_mask(start: int, rows: int, keys: int) -> np.ndarray:
    """bool [S, T]: row i may see key t iff t <= start + i."""
    return np.arange(keys)[None, :] <= (start + np.arange(rows))[:, None]


def masked_softmax(scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of scores [H, S, T], keys outside `allowed` [S, T] excluded."""
    scores = np.where(allowed[None, :, :], scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores, dtype=np.float32)
    probs /= probs.sum(axis=-1, keepdims=True, dtype=np.float32)
    return probs
