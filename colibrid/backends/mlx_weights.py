"""colibri weights as MLX arrays, converted once per weight object (docs/formats.md).

Why most formats map without dequantising: MLX's affine quantisation stores unsigned
codes u with one scale s and one bias b per group, value = s * u + b, packed low bits
first into uint32 words. colibri's grouped int4 stores u = q + 8 (even element in the low
nibble of a byte), value = q * s, so with b = -8 s the codes are the same and
little-endian uint32 words over our bytes are MLX's packing exactly: no repacking. Per-row
int8 maps the same way with 8 bits: u = q + 128 (the int8 byte with its top bit flipped),
b = -128 s, the row's scale repeated over every group of 64 inputs. FP4 is MLX's own
"mxfp4" mode: e2m1 codes packed the same way and the same e8m0 scale bytes, as they are.
The low-bit affine Q2/Q3 are MLX's own affine form too (value = s * q + m per group of 64,
MLX's bias being colibri's minimum), at 2 and 3 bits: the codes are repacked once into
MLX's bit stream (low bits first; colibri's planes are laid out for SIMD unpacking), and
the float16 scales and minimums are widened to float32 (exact), so MLX dequantises to the
reference's values bit for bit: s * q + m, two roundings, as formats.affine computes it.
Anything that does not fit MLX's groups (per-row int4, an I not divisible by the group)
is dequantised to float32 once, as are bf16 and f32 weights.

MLX computes s * u + b where colibri computes (u - 8) * s: the two round differently in
the last bit, so MLX results equal the reference to float tolerance, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from colibrid.formats.affine import AFFINE_BITS, AFFINE_GROUP, unpack_affine
from colibrid.formats.quant import dequantize
from colibrid.formats.weights import AFFINE_FORMATS, QuantWeight, WeightFormat

MLX_GROUPS = (32, 64, 128)
"""Group sizes MLX's affine quantisation supports."""

MLX_MXFP4_GROUP = 32
"""MLX's mxfp4 mode: 32 e2m1 codes per e8m0 scale byte, as MXFP4 (and FP4) store them."""

Q8_GROUP = 64
"""The group a per-row int8 scale is repeated over (any of MLX_GROUPS dividing I works)."""


@dataclass(frozen=True)
class MlxWeight:
    """One weight on the MLX side: quantised (``packed`` codes with per-group scales and
    biases, ``bits`` wide) or dense float32 [O, I] in ``dense``."""

    shape: tuple[int, int]
    dense: mx.array | None = None
    packed: mx.array | None = None
    scales: mx.array | None = None
    biases: mx.array | None = None
    group_size: int = 0
    bits: int = 0
    mode: str = "affine"  # or "mxfp4": e8m0 scales, no biases

    @property
    def nbytes(self) -> int:
        """The bytes of its MLX arrays (what the device tier counts)."""
        arrays = (self.dense, self.packed, self.scales, self.biases)
        return sum(a.nbytes for a in arrays if a is not None)

    def rows(self, lo: int, hi: int) -> MlxWeight:
        """Rows [lo, hi) as a weight of their own (a lazy slice, no copy until used)."""
        shape = (hi - lo, self.shape[1])
        if self.dense is not None:
            return MlxWeight(shape, dense=self.dense[lo:hi])
        assert self.packed is not None and self.scales is not None
        return MlxWeight(
            shape,
            packed=self.packed[lo:hi],
            scales=self.scales[lo:hi],
            biases=None if self.biases is None else self.biases[lo:hi],
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )

    def matmul(self, x: mx.array) -> mx.array:
        """x [..., I] @ W^T -> [..., O], lazily."""
        if x.ndim == 1:
            return self.matmul(x[None])[0]
        if self.dense is not None:
            return x @ self.dense.T
        return mx.quantized_matmul(
            x,
            self.packed,
            self.scales,
            self.biases,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )


def convert(w: QuantWeight) -> MlxWeight:
    """``w`` on the MLX side, converted now (MlxOps' device tier keeps it)."""
    if not isinstance(w, QuantWeight):
        raise ValueError("the mlx backend computes on QuantWeight weights")
    o, i = w.shape
    if w.fmt is WeightFormat.Q4 and w.group_size in MLX_GROUPS and i % w.group_size == 0:
        assert w.scales is not None
        scales = np.ascontiguousarray(w.scales, dtype=np.float32).reshape(o, i // w.group_size)
        words = np.ascontiguousarray(w.data).view(np.uint8).reshape(o, i // 2).view("<u4")
        return _quantised(w.shape, words, scales, 8, w.group_size, 4)
    if w.fmt is WeightFormat.FP4 and w.group_size == MLX_MXFP4_GROUP and i % 32 == 0:
        assert w.scales is not None
        words = np.ascontiguousarray(w.data).view(np.uint8).reshape(o, i // 2).view("<u4")
        scales = np.ascontiguousarray(w.scales, dtype=np.uint8).reshape(o, i // 32)
        return MlxWeight(
            w.shape,
            packed=mx.array(words),
            scales=mx.array(scales),
            group_size=MLX_MXFP4_GROUP,
            bits=4,
            mode="mxfp4",
        )
    if w.fmt in AFFINE_FORMATS and i % AFFINE_GROUP == 0:
        return _affine(w)
    if w.fmt is WeightFormat.Q8 and i % Q8_GROUP == 0:
        assert w.scales is not None
        codes = np.ascontiguousarray(w.data).view(np.uint8) ^ np.uint8(0x80)  # q + 128
        per_row = np.ascontiguousarray(w.scales, dtype=np.float32).reshape(o, 1)
        scales = np.repeat(per_row, i // Q8_GROUP, axis=1)
        return _quantised(w.shape, codes.view("<u4"), scales, 128, Q8_GROUP, 8)
    return MlxWeight(w.shape, dense=mx.array(dequantize(w)))


def _affine(w: QuantWeight) -> MlxWeight:
    """A Q2/Q3 weight (I a whole number of groups) as MLX affine arrays: each row's codes
    as one little-endian bit stream, ``bits`` a code, lowest bit first (MLX's packing,
    which for 3 bits lets a code straddle two words), scales and minimums in float32."""
    assert w.scales is not None
    o, i = w.shape
    bits = AFFINE_BITS[w.fmt]
    codes = unpack_affine(w.data, w.fmt, i)
    planes = (codes[:, :, None] >> np.arange(bits, dtype=np.uint8)) & np.uint8(1)
    stream = np.packbits(planes.reshape(o, i * bits), axis=1, bitorder="little")
    pairs = np.asarray(w.scales, dtype=np.float16).astype(np.float32).reshape(o, -1, 2)
    return MlxWeight(
        w.shape,
        packed=mx.array(np.ascontiguousarray(stream).view("<u4")),
        scales=mx.array(np.ascontiguousarray(pairs[:, :, 0])),
        biases=mx.array(np.ascontiguousarray(pairs[:, :, 1])),
        group_size=AFFINE_GROUP,
        bits=bits,
    )


def _quantised(
    shape: tuple[int, int],
    words: np.ndarray,
    scales: np.ndarray,
    zero: int,
    group_size: int,
    bits: int,
) -> MlxWeight:
    """MLX affine arrays for codes ``words`` whose value is (code - zero) * scale."""
    biases = (scales * np.float32(-zero)).astype(np.float32)
    return MlxWeight(
        shape,
        packed=mx.array(words),
        scales=mx.array(scales),
        biases=mx.array(biases),
        group_size=group_size,
        bits=bits,
    )
