"""Low-bit affine weights (Q2, Q3): the numpy reference of the cold-expert format.

Why a third quantisation family: an expert the router rarely picks costs its bytes on
every read from disk and in every cache slot it takes, while its share of the output is
small; 2 or 3 bits a weight make such experts 2.5 or 3.5 bits a weight stored instead of
int4-g64's 4.5. Symmetric absmax (quant.py) wastes a quarter of a 2-bit grid's four
levels on a sign nobody needs when a group is lopsided, so these codes are unsigned with
a per-group minimum (asymmetric affine, as llama.cpp's K-quants and HQQ do):

* groups of ``AFFINE_GROUP`` = 64 inputs along I; the last group may be shorter and takes
  the minimum and maximum of its own elements (its padding codes are 0);
* ``m = float16(min(w))`` (round to nearest even); ``s = float16(max(0, (max(w) - m) /
  qmax))`` with ``m`` taken back to float32 first and the division in float32, qmax =
  2^bits - 1 (3 or 7); a constant group whose value float16 holds (zero among them)
  therefore gets ``s = 0`` and every code 0, exactly; another keeps a tiny ``s`` that
  makes up most of m's rounding;
* ``q = clip(rint((w - m) / s), 0, qmax)`` in float32 (``rint``: half to even), 0 where
  ``s == 0``;
* dequantised ``w' = float32(q) * s + m`` in float32, two roundings (no fused multiply-add):
  what the F32 kernel family computes (it may contract; it only has to be accurate);
* the I8 family computes a group's share of an output exactly as the reference kernel
  (native/src/ref/ref.c) defines: with int8 activations ``x`` of scale ``xs``,
  ``isum = sum(q * x)`` and ``xsum = sum(x)`` over the group (exact int32), then
  ``acc = acc + ((float)isum * (s * xs) + (float)xsum * (m * xs))``, groups in order.

Layout of a row: ``ceil(I/64)`` blocks, one per group, of 16 bytes (Q2) or 24 (Q3):

* bytes 0..15, the low plane: bits ``2k, 2k+1`` of byte ``j`` are the low two bits of the
  code of input ``16k + j`` of the group (k = 0..3), so one shift and mask gives 16
  consecutive codes;
* Q3's bytes 16..23, the high plane: bit ``b`` of byte ``16 + j`` is bit 2 of the code of
  input ``8b + j`` (b = 0..7), so a byte broadcast and a bit test give 8 consecutive ones.

Scales are float16 ``[O, 2 * G]``: group g's ``s`` at column ``2g``, its ``m`` at ``2g + 1``.
A group whose range does not fit float16 (|w| beyond 65504) is refused.
"""

from __future__ import annotations

import numpy as np

from colibrid.formats.weights import QuantWeight, WeightFormat

AFFINE_GROUP = 64
"""Inputs per group: the block layout's planes are defined for 64 codes."""

AFFINE_BITS = {WeightFormat.Q2: 2, WeightFormat.Q3: 3}
BLOCK_BYTES = {WeightFormat.Q2: 16, WeightFormat.Q3: 24}
"""Bytes per group of 64 codes: the low plane, plus Q3's high plane of 8 bytes."""

_ROWS_PER_BLOCK = 1 << 14


def affine_groups(in_features: int) -> int:
    """Groups of a row: ceil(I / 64)."""
    return -(-in_features // AFFINE_GROUP)


def affine_row_bytes(fmt: WeightFormat, in_features: int) -> int:
    """Bytes of one row's codes: a whole block per group, the last one padded."""
    return BLOCK_BYTES[fmt] * affine_groups(in_features)


def bits_per_weight(fmt: WeightFormat) -> float:
    """Stored bits per weight of a full group: codes plus two float16 per 64 inputs."""
    return AFFINE_BITS[fmt] + 32 / AFFINE_GROUP


def pack_affine(codes: np.ndarray, fmt: WeightFormat) -> np.ndarray:
    """uint8 codes [R, 64 * G] (0..qmax) -> the blocks [R, G * BLOCK_BYTES[fmt]]."""
    rows, cols = codes.shape
    groups = cols // AFFINE_GROUP
    c = codes.reshape(rows, groups, 4, 16)
    low = (c & 3).astype(np.uint8)
    plane = low[:, :, 0] | (low[:, :, 1] << 2) | (low[:, :, 2] << 4) | (low[:, :, 3] << 6)
    if fmt is WeightFormat.Q2:
        return np.ascontiguousarray(plane.reshape(rows, groups * 16))
    high = ((codes >> 2) & 1).astype(np.uint8).reshape(rows, groups, 8, 8)
    hplane = np.zeros((rows, groups, 8), dtype=np.uint8)
    for b in range(8):
        hplane |= high[:, :, b] << b
    return np.ascontiguousarray(np.concatenate([plane, hplane], axis=2).reshape(rows, -1))


def unpack_affine(data: np.ndarray, fmt: WeightFormat, in_features: int) -> np.ndarray:
    """The blocks [R, G * BLOCK_BYTES] -> uint8 codes [R, I] (pack_affine undone)."""
    rows = data.shape[0]
    groups = affine_groups(in_features)
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, groups, BLOCK_BYTES[fmt])
    plane = blocks[:, :, :16]
    codes = np.stack([(plane >> (2 * k)) & 3 for k in range(4)], axis=2)  # [R, G, k, j]
    if fmt is WeightFormat.Q3:
        hplane = blocks[:, :, 16:24]
        high = np.stack([(hplane >> b) & 1 for b in range(8)], axis=2)  # [R, G, b, j]
        codes = codes | (high.reshape(rows, groups, 4, 16) << 2)
    return codes.reshape(rows, groups * AFFINE_GROUP)[:, :in_features]


def _quantize_rows(w: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of w [R, I] f32 -> (codes uint8 [R, 64 G], scales float16 [R, 2 G])."""
    rows, cols = w.shape
    groups = affine_groups(cols)
    width = groups * AFFINE_GROUP
    lo_pad = np.full((rows, width), np.inf, dtype=np.float32)
    lo_pad[:, :cols] = w
    hi_pad = np.full((rows, width), -np.inf, dtype=np.float32)
    hi_pad[:, :cols] = w
    lo = lo_pad.reshape(rows, groups, AFFINE_GROUP).min(axis=2)
    hi = hi_pad.reshape(rows, groups, AFFINE_GROUP).max(axis=2)
    with np.errstate(over="ignore"):
        m16 = lo.astype(np.float16)
        m = m16.astype(np.float32)
        s16 = np.maximum((hi - m) / np.float32(qmax), np.float32(0)).astype(np.float16)
    if not (np.isfinite(m16).all() and np.isfinite(s16).all()):
        raise ValueError("a group's range does not fit float16 (|w| > 65504)")
    s = s16.astype(np.float32)
    grouped = np.where(np.isfinite(lo_pad), lo_pad, np.float32(0)).reshape(rows, groups, -1)
    safe = np.where(s > 0, s, np.float32(1))[:, :, None]
    q = np.clip(np.rint((grouped - m[:, :, None]) / safe), 0, qmax)
    q = np.where(s[:, :, None] > 0, q, 0).reshape(rows, width).astype(np.uint8)
    q[:, cols:] = 0
    scales = np.stack([s16, m16], axis=2).reshape(rows, 2 * groups)
    return q, scales


def quantize_affine(w: np.ndarray, fmt: WeightFormat) -> QuantWeight:
    """Quantise a 2-D weight [O, I] to Q2 or Q3 (module docstring), in row blocks."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize expects a 2-D weight, got shape {w.shape}")
    if fmt not in AFFINE_BITS:
        raise ValueError(f"quantize_affine supports Q2 and Q3, not {fmt}")
    rows, cols = w.shape
    qmax = (1 << AFFINE_BITS[fmt]) - 1
    data = np.empty((rows, affine_row_bytes(fmt, cols)), dtype=np.uint8)
    scales = np.empty((rows, 2 * affine_groups(cols)), dtype=np.float16)
    step = max(1, _ROWS_PER_BLOCK * 64 // max(cols, 1))
    for r0 in range(0, rows, step):
        block = np.asarray(w[r0 : r0 + step], dtype=np.float32)
        if not np.isfinite(block).all():
            raise ValueError(f"cannot quantise non-finite values (rows {r0}..{r0 + len(block)})")
        q, s = _quantize_rows(block, qmax)
        data[r0 : r0 + step] = pack_affine(q, fmt)
        scales[r0 : r0 + step] = s
    return QuantWeight(fmt, (rows, cols), data, scales, AFFINE_GROUP)


def dequantize_affine_rows(
    fmt: WeightFormat, in_features: int, data: np.ndarray, scales: np.ndarray
) -> np.ndarray:
    """Rows of a Q2/Q3 weight -> float32 [R, I]: float32(q) * s + m, two roundings."""
    q = unpack_affine(data, fmt, in_features).astype(np.float32)
    sm = np.asarray(scales, dtype=np.float16).astype(np.float32).reshape(len(q), -1, 2)
    s = np.repeat(sm[:, :, 0], AFFINE_GROUP, axis=1)[:, :in_features]
    m = np.repeat(sm[:, :, 1], AFFINE_GROUP, axis=1)[:, :in_features]
    return q * s + m


def affine_sample(fmt: WeightFormat, rows: int, cols: int, rng: np.random.Generator) -> QuantWeight:
    """A Q2/Q3 weight of random codes and plausible scales: what the calibration and
    `colibri bench kernels` time (the kernels' speed does not depend on the values)."""
    data = rng.integers(0, 256, (rows, affine_row_bytes(fmt, cols)), dtype=np.uint8)
    sm = np.empty((rows, affine_groups(cols), 2), dtype=np.float16)
    sm[:, :, 0] = rng.uniform(1e-3, 1e-2, sm.shape[:2])
    sm[:, :, 1] = rng.uniform(-2e-2, 0, sm.shape[:2])
    return QuantWeight(fmt, (rows, cols), data, sm.reshape(rows, -1), AFFINE_GROUP)
