"""Normalisations, in float32 exactly as the reference computes them."""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: weight * x / sqrt(mean(x^2) + eps), all in float32.

    The mean is written out as numpy's `mean` computes it (a pairwise float32 sum, then a
    float32 division by the count), bit for bit, without `mean`'s Python-level overhead:
    decode normalises one row twice per layer, and the wrapper cost more than the sum.
    """
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    variance = np.add.reduce(x * x, axis=-1, keepdims=True, dtype=np.float32)
    variance /= np.float32(x.shape[-1])
    variance += np.float32(eps)
    scale = np.float32(1.0) / np.sqrt(variance)
    return weight * (x * scale)


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis (biased variance), float32."""
    mean = np.mean(x, axis=-1, keepdims=True, dtype=np.float32)
    centred = x - mean
    variance = np.mean(np.square(centred), axis=-1, keepdims=True, dtype=np.float32)
    return (centred / np.sqrt(variance + np.float32(eps))) * weight + bias
