"""Weight formats and the quantised weight type: what a stored or resident matrix is.

Shared by the converter (which writes them), the store (which maps and reads them), the
models (which hold them) and every backend (whose kernels compute on them); it imports
nothing from colibrid, so every package can depend on it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class WeightFormat(enum.Enum):
    """On-disk / in-memory weight formats (docs/formats.md; upstream fmt numbers in comments)."""

    F32 = "f32"  # fmt 0
    BF16 = "bf16"  # stored as uint16
    Q8 = "q8"  # fmt 1: int8 per row, O scales
    Q4 = "q4"  # fmt 2 (group_size == 0, per row) or fmt 4 (grouped, gs 64 default)
    # MXFP4 kept as stored: e2m1 codes packed as Q4's nibbles, each standing for an integer
    # of the doubled e2m1 grid (quant.FP4_VALUES), and MXFP4's e8m0 scale byte per 32 inputs
    FP4 = "fp4"
    # Low-bit affine codes for cold experts (formats.affine): unsigned 2- or 3-bit codes
    # per input, a float16 scale and minimum per group of 64 inputs, w = s * q + m
    Q2 = "q2"
    Q3 = "q3"


@dataclass(frozen=True)
class QuantWeight:
    """A 2-D weight [O, I] in one of the supported formats, resident in host memory.

    data:
      F32  -> float32 [O, I]
      BF16 -> uint16  [O, I] (the upper half of the f32 bit pattern)
      Q8   -> int8    [O, I]
      Q4   -> uint8   [O, ceil(I/2)]: nibble = q + 8, even element in the low nibble
      FP4  -> uint8   [O, ceil(I/2)]: nibble = an e2m1 code (value FP4_VALUES[code]),
              even element in the low nibble
      Q2   -> uint8   [O, 16 * ceil(I/64)]: a 16-byte block per group of 64 (formats.affine)
      Q3   -> uint8   [O, 24 * ceil(I/64)]: the same 16 bytes plus an 8-byte high-bit plane
    scales: float32, None for F32/BF16; [O] for Q8 and per-row Q4; [O, ceil(I/gs)] for
      grouped Q4; uint8 e8m0 bytes [O, ceil(I/gs)] for FP4 (a group's factor 2^(e - 128));
      float16 [O, 2 * ceil(I/64)] for Q2/Q3, each group's scale then its minimum.
    group_size: 0 means per-row scales (only meaningful for Q4; FP4 is always grouped;
      Q2/Q3 always 64).

    Arrays must be C-contiguous. They may be views into an mmap or a slab.
    """

    fmt: WeightFormat
    shape: tuple[int, int]
    data: np.ndarray
    scales: np.ndarray | None = None
    group_size: int = 0

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        extra = 0 if self.scales is None else self.scales.nbytes
        return self.data.nbytes + extra

    @property
    def layout(self) -> WeightLayout:
        return WeightLayout.of(self.fmt, self.group_size, self.in_features)


class WeightLayout(NamedTuple):
    """What a kernel's speed depends on beyond the row count: the format, the group of a
    grouped format (I when one scale covers the row, 0 for other formats) and I."""

    fmt: WeightFormat
    group: int
    in_features: int

    @classmethod
    def of(cls, fmt: WeightFormat, group_size: int, in_features: int) -> WeightLayout:
        group = 0
        if fmt in GROUPED_FORMATS:
            group = group_size if 0 < group_size < in_features else in_features
        return cls(fmt, group, in_features)


NIBBLE_FORMATS = frozenset({WeightFormat.Q4, WeightFormat.FP4})
"""Formats of two codes a byte and one scale per group (Q4's layout)."""

AFFINE_FORMATS = frozenset({WeightFormat.Q2, WeightFormat.Q3})
"""Low-bit formats of unsigned codes with a scale and a minimum per group of 64
(colibrid.formats.affine): what cold experts may be stored in."""

GROUPED_FORMATS = NIBBLE_FORMATS | AFFINE_FORMATS
"""Formats whose scales are per group of inputs."""
