"""colibri weights in GPU memory, as the container stores them (codes and scales,
docs/formats.md): the kernels read every format directly, so the copy is the whole
conversion. Which weights stay on the GPU is the device tier's choice
(backends.device_tier)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from colibrid.backends.cuda_device import Buffer, Device
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
"""Each format's number in native/cuda/kernels.cu (FMT_*)."""

AFFINE_CODES = frozenset(FORMAT_CODES[f] for f in AFFINE_FORMATS)
"""The numbers of Q2 and Q3, whose I8 partial sums are two integers a chunk (kernels.cu)."""


@dataclass(frozen=True, eq=False)
class DeviceWeight:
    """One weight [O, I] on the device: rows of ``row_bytes`` at ``data``, scales (if any)
    at ``scales``, ``groups`` of ``group`` inputs a row."""

    shape: tuple[int, int]
    fmt: int
    data: int
    scales: int
    row_bytes: int
    group: int
    groups: int
    # one group's scale bytes: 4 for a float (or Q2/Q3's float16 scale and minimum), 1 for
    # FP4's e8m0 byte, 0 for none
    scale_bytes: int
    buffers: tuple[Buffer, ...] = field(default=(), repr=False)  # what keeps the memory

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def rows(self, lo: int, hi: int) -> DeviceWeight:
        """Rows [lo, hi) as a weight of their own, sharing the memory."""
        return DeviceWeight(
            (hi - lo, self.shape[1]),
            self.fmt,
            self.data + lo * self.row_bytes,
            self.scales + lo * self.groups * self.scale_bytes,
            self.row_bytes,
            self.group,
            self.groups,
            self.scale_bytes,
            self.buffers,
        )


def upload(device: Device, w: QuantWeight) -> DeviceWeight:
    """``w``'s bytes copied to the device, as stored."""
    o, i = w.shape
    data = np.ascontiguousarray(w.data)
    row_bytes = data.nbytes // o if o else 0
    data_buf = device.alloc(data.nbytes)
    device.upload(data_buf.ptr, data)
    buffers: tuple[Buffer, ...] = (data_buf,)
    scales_ptr, scale_bytes, group, groups = 0, 0, i, 1
    if w.scales is not None:
        scales = np.ascontiguousarray(w.scales)
        if w.fmt in NIBBLE_FORMATS and 0 < w.group_size < i:
            group, groups = w.group_size, -(-i // w.group_size)
        scale_buf = device.alloc(scales.nbytes)
        device.upload(scale_buf.ptr, scales)
        buffers += (scale_buf,)
        scales_ptr, scale_bytes = scale_buf.ptr, scales.itemsize
        if w.fmt in AFFINE_FORMATS:  # a float16 (s, m) pair a group, even for one group
            group, groups, scale_bytes = w.group_size, -(-i // w.group_size), 2 * scales.itemsize
    return DeviceWeight(
        (o, i), FORMAT_CODES[w.fmt], data_buf.ptr, scales_ptr, row_bytes, group, groups,
        scale_bytes, buffers,
    )  # fmt: skip
