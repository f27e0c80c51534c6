"""How a stored matrix looks in memory, so that one checked weight stands for all of its kind.

Why this module exists: a GLM-5 container holds ~60,000 expert matrices in a handful of
size signatures. Checking each one's format from scratch cost ~40 µs at every load; once
one matrix of a signature has been opened as a weight (every check run), the others of
that signature differ only in where their bytes are, so a :class:`ViewSpec` rebuilds
them as zero-copy views. The checkpoint uses it for weights read from the mmap, the
tiered store for experts read into a slab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from colibrid.formats.weights import QuantWeight, WeightFormat


@dataclass(frozen=True)
class ViewSpec:
    """How one matrix looks in memory: enough to rebuild its QuantWeight from raw bytes."""

    fmt: WeightFormat
    shape: tuple[int, int]
    dtype: np.dtype
    data_shape: tuple[int, ...]
    scales_shape: tuple[int, ...] | None
    group_size: int
    scales_dtype: np.dtype = np.dtype(np.float32)  # FP4: its e8m0 bytes

    @classmethod
    def of(cls, w: QuantWeight) -> ViewSpec:
        scales = None if w.scales is None else tuple(w.scales.shape)
        scales_dtype = np.dtype(np.float32) if w.scales is None else w.scales.dtype
        return cls(
            w.fmt, w.shape, w.data.dtype, tuple(w.data.shape), scales, w.group_size, scales_dtype
        )

    @cached_property  # a tiered store asks at every expert it reads
    def data_nbytes(self) -> int:
        return math.prod(self.data_shape) * self.dtype.itemsize  # np.prod: ~5 µs a call

    @cached_property
    def scales_nbytes(self) -> int:
        if self.scales_shape is None:
            return 0
        return math.prod(self.scales_shape) * self.scales_dtype.itemsize

    def build(self, data: np.ndarray, scales: np.ndarray | None) -> QuantWeight:
        """The weight over ``data`` and ``scales`` (flat uint8 arrays of exactly
        ``data_nbytes`` and ``scales_nbytes``), without copying."""
        scale_view = None
        if self.scales_shape is not None and scales is not None:
            scale_view = scales.view(self.scales_dtype).reshape(self.scales_shape)
        return QuantWeight(
            self.fmt,
            self.shape,
            data.view(self.dtype).reshape(self.data_shape),
            scale_view,
            self.group_size,
        )


def bad_scales(scales: np.ndarray) -> str | None:
    """Why a weight's scales cannot be used (a non-finite factor), or None. F32 scales
    must be finite; FP4's e8m0 bytes must not be 0xFF, e8m0's NaN."""
    if scales.dtype == np.uint8:
        return "non-finite scale (e8m0 NaN byte)" if (scales == 0xFF).any() else None
    return None if np.isfinite(scales).all() else "non-finite scale"
