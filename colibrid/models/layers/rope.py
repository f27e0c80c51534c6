"""Rotary position embeddings in the two layouts the supported families use.

- "half" (Llama / GLM-4 `rotate_half`): the rotated dims are split into two halves and
  dim j pairs with dim j + d/2. With a partial factor only the first `dim` dims rotate.
- "interleave" (DeepSeek / GLM-5 MLA and the DSA indexer): dims (2j, 2j+1) form a pair;
  the rotated pair is written to positions (j, d/2 + j). Queries and keys get the same
  permutation, so dot products equal the interleaved rotation; the cached keys keep the
  permuted layout, as in the reference.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from colibrid.errors import ConfigError


class Rotary:
    """cos/sin tables for `dim` rotated dims; computed per call for the given positions."""

    def __init__(self, dim: int, params: dict[str, Any], *, max_positions: int) -> None:
        if dim <= 0 or dim % 2:
            raise ConfigError(f"config.json: rotary dimension {dim} must be a positive even number")
        theta = params.get("rope_theta", 10000.0)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
            raise ConfigError(f"config.json: rope_theta = {theta!r} must be a number > 1")
        rope_type = params.get("rope_type", "default")
        self.dim = dim
        exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
        self.attention_factor = 1.0
        if rope_type == "yarn":
            inv_freq, self.attention_factor = _yarn(
                inv_freq, dim, float(theta), params, max_positions
            )
        elif rope_type != "default":
            raise ConfigError(
                f"config.json: rope type {rope_type!r} is not supported (supported: default, yarn)"
            )
        self.inv_freq = inv_freq

    def tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin of shape [S, dim/2] for integer positions [S]."""
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        cos = np.cos(freqs).astype(np.float32)
        sin = np.sin(freqs).astype(np.float32)
        if self.attention_factor != 1.0:
            cos = cos * np.float32(self.attention_factor)
            sin = sin * np.float32(self.attention_factor)
        return cos, sin


def apply_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """rotate_half layout. x: [S, H, d_head]; cos/sin: [S, rot/2]; rotates the first rot dims."""
    half = cos.shape[-1]
    c = cos[:, None, :]
    s = sin[:, None, :]
    x1 = x[..., :half]
    x2 = x[..., half : 2 * half]
    out = np.empty_like(x)
    out[..., :half] = x1 * c - x2 * s
    out[..., half : 2 * half] = x2 * c + x1 * s
    out[..., 2 * half :] = x[..., 2 * half :]
    return out


def apply_interleave(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Interleaved-pair layout. x: [S, H, rot] (exactly the rotated dims); cos/sin [S, rot/2]."""
    c = cos[:, None, :]
    s = sin[:, None, :]
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _yarn(
    inv_freq: np.ndarray, dim: int, theta: float, params: dict[str, Any], max_positions: int
) -> tuple[np.ndarray, float]:
    """YaRN frequency blend (as transformers' `_compute_yarn_parameters`)."""
    try:
        factor = float(params.get("factor") or 1.0)
        original = int(params.get("original_max_position_embeddings") or max_positions)
        beta_fast = float(params.get("beta_fast") or 32.0)
        beta_slow = float(params.get("beta_slow") or 1.0)
        mscale = params.get("mscale")
        mscale_all_dim = params.get("mscale_all_dim")
        attention_factor = params.get("attention_factor")
        truncate = bool(params.get("truncate", True))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config.json: bad yarn rope parameters: {exc}") from None
    if not (factor >= 1.0 and original > 0 and beta_fast > 0 and beta_slow > 0):
        raise ConfigError("config.json: yarn rope parameters out of range")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = correction_dim(beta_fast)
    high = correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    ramp = np.clip(ramp, 0, 1).astype(np.float32)
    extrapolation = (1 - ramp).astype(np.float32)
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    interpolation = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    extrap = (1.0 / pos_freqs).astype(np.float32)
    blended = interpolation * (1 - extrapolation) + extrap * extrapolation
    return blended.astype(np.float32), float(attention_factor)
