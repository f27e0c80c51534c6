"""colibri weights in a WebGPU device's memory, as the container stores them (codes and
scales, docs/formats.md): the kernels read every format directly, so the copy is the whole
conversion. A weight larger than one storage binding may be (lavapipe: 128 MiB; a
GLM-5-sized head is ~950 MB at int8) is held as several pieces of whole rows, each bound
alone. Which weights stay on the device is the device tier's choice
(backends.device_tier)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colibrid.backends.webgpu_device import GpuDevice
from colibrid.formats.weights import AFFINE_FORMATS, NIBBLE_FORMATS, QuantWeight, WeightFormat

FORMAT_CODES = {
    WeightFormat.F32: 0,
    WeightFormat.BF16: 1,
    WeightFormat.Q8: 2,
    WeightFormat.Q4: 3,
    WeightFormat.FP4: 4,
    WeightFormat.Q2: 5,
    WeightFormat.Q3: 6,
}
"""Each format's number in native/webgpu/kernels.wgsl (FMT_*)."""


@dataclass(frozen=True, eq=False)
class Piece:
    """Rows [row0, row0 + rows) of a weight: their bytes and their scales (or None)."""

    row0: int
    rows: int
    data: Any
    scales: Any


@dataclass(eq=False)
class GpuWeight:
    """One weight [O, I] on the device: ``pieces`` of whole rows of ``row_bytes`` each,
    ``groups`` scale groups of ``group`` inputs a row. ``groups_bound`` keeps the bind
    groups made for it (per piece and scratch buffers), which live as long as it does."""

    shape: tuple[int, int]
    fmt: int
    row_bytes: int
    group: int
    groups: int
    pieces: tuple[Piece, ...]
    nbytes: int
    bound: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)

    @property
    def split(self) -> bool:
        return len(self.pieces) > 1


def upload(device: GpuDevice, w: QuantWeight) -> GpuWeight:
    """``w``'s bytes copied to the device as stored, in pieces each within one binding."""
    o, i = w.shape
    data = np.ascontiguousarray(w.data).reshape(o, -1).view(np.uint8)
    row_bytes = data.shape[1]
    scales = None if w.scales is None else np.ascontiguousarray(w.scales).reshape(o, -1)
    group, groups = i, 1
    if w.fmt in NIBBLE_FORMATS and 0 < w.group_size < i:
        group, groups = w.group_size, -(-i // w.group_size)
    if w.fmt in AFFINE_FORMATS:  # a word of float16 (s, m) a group, even for one group
        group, groups = w.group_size, -(-i // w.group_size)
    scale_row = 0 if scales is None else scales.nbytes // max(o, 1)
    per_piece = max(1, (device.max_binding - 8) // max(row_bytes, scale_row, 1))
    pieces = []
    for lo in range(0, o, per_piece):
        hi = min(o, lo + per_piece)
        pieces.append(
            Piece(
                lo,
                hi - lo,
                device.upload(data[lo:hi]),
                None if scales is None else device.upload(scales[lo:hi]),
            )
        )
    nbytes = data.nbytes + (0 if scales is None else scales.nbytes)
    return GpuWeight((o, i), FORMAT_CODES[w.fmt], row_bytes, group, groups, tuple(pieces), nbytes)
