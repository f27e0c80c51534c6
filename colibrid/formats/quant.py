"""The numpy reference of the quantisation maths (docs/formats.md), bit-equal to upstream.

Why a reference in numpy: the converter writes containers with it, the tests check the
C kernels against it bit for bit, and a model read from a colibri container must
compute exactly what the upstream engine computes. So every step below is the
documented recipe, in float32, with no shortcut that could round differently:

* symmetric absmax per row (or per group of ``gs`` inputs along I; the last group may be
  partial and takes the absmax over its own elements only);
* ``s = max(absmax / qmax, 1e-8)`` in float32 (an all-zero row gets the scale 1e-8);
* ``q = clip(rint(w / s), qmin, qmax)`` in float32; ``np.rint`` rounds half to even;
* int8: qmax 127, clip to [-128, 127];
  int4: qmax 7, clip to [-8, 7], stored as ``q + 8`` with the even element in the low
  nibble, a row is ceil(I/2) bytes and an odd I pads the last high nibble with 8 (q=0);
* dequantised value = ``float32(q) * s`` (one f32 rounding), which is what the F32
  kernel family computes in registers.

Everything is processed in row blocks so a huge tensor never needs more than one block
of temporaries; this is bit-identical to whole-tensor processing because every scale
belongs to one row.
"""

from __future__ import annotations

import numpy as np

from colibrid.formats.affine import dequantize_affine_rows, quantize_affine
from colibrid.formats.weights import AFFINE_FORMATS, QuantWeight, WeightFormat

SCALE_FLOOR = np.float32(1e-8)
BLOCK_ELEMENTS = 1 << 22
"""Elements per row block (~16 MB of f32 temporaries)."""

FP8_BLOCK = 128
"""HF FP8 checkpoints (and upstream fmt=8) scale 128x128 blocks."""


def _row_block(n_cols: int) -> int:
    return max(1, BLOCK_ELEMENTS // max(1, n_cols))


def q4_row_bytes(in_features: int) -> int:
    return (in_features + 1) // 2


def n_groups(in_features: int, group_size: int) -> int:
    return 1 if group_size == 0 else -(-in_features // group_size)


# ---- quantise ---------------------------------------------------------------------


def _quantize_block(w: np.ndarray, qmax: int, qmin: int, group_size: int) -> tuple:
    """Quantise rows of ``w`` [R, I] f32 -> (q int8 [R, I], scales f32 [R, G])."""
    rows, cols = w.shape
    gs = cols if group_size == 0 else group_size
    groups = n_groups(cols, group_size)
    padded = np.zeros((rows, groups * gs), dtype=np.float32)
    padded[:, :cols] = w  # zero padding never raises an absmax
    grouped = padded.reshape(rows, groups, gs)
    absmax = np.max(np.abs(grouped), axis=2)
    scales = np.maximum(absmax / np.float32(qmax), SCALE_FLOOR).astype(np.float32)
    q = np.clip(np.rint(grouped / scales[:, :, None]), qmin, qmax)
    return q.reshape(rows, groups * gs)[:, :cols].astype(np.int8), scales


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """int8 q in [-8, 7], [R, I] -> uint8 [R, ceil(I/2)], even element in the low nibble."""
    return pack_codes((q + 8).astype(np.uint8))


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """uint8 nibble codes 0..15, [R, I] -> uint8 [R, ceil(I/2)], even element in the low
    nibble; an odd row ends with code 8 (Q4's zero)."""
    rows, cols = codes.shape
    if cols % 2:
        codes = np.concatenate([codes, np.full((rows, 1), 8, dtype=np.uint8)], axis=1)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def nibble_codes(packed: np.ndarray, cols: int) -> np.ndarray:
    """uint8 [R, ceil(I/2)] -> the uint8 codes 0..15 [R, I] (pack_codes undone): for
    moving codes about losslessly, without the float detour of unpack_nibbles."""
    codes = np.empty((packed.shape[0], 2 * packed.shape[1]), dtype=np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    return codes[:, :cols]


def quantize(w: np.ndarray, fmt: WeightFormat, group_size: int = 64) -> QuantWeight:
    """Quantise a 2-D weight [O, I] to Q8 (per row), Q4 (per row or grouped) or the
    low-bit affine Q2/Q3 (groups of 64, colibrid.formats.affine).

    ``group_size`` applies to Q4 only: 0 means one scale per row, otherwise one scale
    per ``group_size`` inputs. Q8 is always per row (upstream groups only at <= 4 bits);
    Q2 and Q3 always group 64 inputs (their block layout is defined for 64).
    """
    if fmt in AFFINE_FORMATS:
        return quantize_affine(w, fmt)
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize expects a 2-D weight, got shape {w.shape}")
    if fmt not in (WeightFormat.Q8, WeightFormat.Q4):
        raise ValueError(f"quantize supports Q8, Q4, Q2 and Q3, not {fmt}")
    if group_size < 0:
        raise ValueError(f"group_size must be >= 0, got {group_size}")
    rows, cols = w.shape
    if fmt is WeightFormat.Q8:
        group_size, qmax, qmin = 0, 127, -128
        data = np.empty((rows, cols), dtype=np.int8)
    else:
        qmax, qmin = 7, -8
        data = np.empty((rows, q4_row_bytes(cols)), dtype=np.uint8)
    scales = np.empty((rows, n_groups(cols, group_size)), dtype=np.float32)
    step = _row_block(cols)
    for r0 in range(0, rows, step):
        block = np.asarray(w[r0 : r0 + step], dtype=np.float32)
        if not np.isfinite(block).all():
            raise ValueError(f"cannot quantise non-finite values (rows {r0}..{r0 + len(block)})")
        q, s = _quantize_block(block, qmax, qmin, group_size)
        data[r0 : r0 + step] = q if fmt is WeightFormat.Q8 else pack_nibbles(q)
        scales[r0 : r0 + step] = s
    if group_size == 0:
        scales = scales.reshape(rows)
    return QuantWeight(fmt, (rows, cols), data, np.ascontiguousarray(scales), group_size)


# ---- dequantise -------------------------------------------------------------------


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 stored as uint16 -> float32 (exact: bf16 is the top half of f32)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 as uint16, rounded to nearest even (finite inputs): exact for
    any value with at most 8 significant bits, e.g. MXFP4's e2m1 times 2^k."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16)


FP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
"""What each FP4 code (sign bit 3, two exponent bits, one mantissa bit: e2m1) stands for:
e2m1's value {0, 0.5, 1, 1.5, 2, 3, 4, 6} doubled, so every code is an integer and FP4
computes as Q4 does (both kernel families) with this table instead of ``n - 8``. The
scales are MXFP4's own e8m0 bytes; a group's factor is half the e8m0 value, 2^(e - 128)
(`fp4_scales`), so a weight is FP4_VALUES[code] * 2^(e - 128) = e2m1 * 2^(e - 127), exact."""
FP4_GROUP = 32  # MXFP4's block: one scale per 32 inputs


def fp4_scales(e8m0: np.ndarray) -> np.ndarray:
    """FP4 scale bytes -> the float32 factor of each group, 2^(e - 128) (exact; 0xFF NaN)."""
    return e8m0_to_f32(e8m0) * np.float32(0.5)


def fp4_from_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> QuantWeight:
    """An MXFP4 matrix as stored (gpt-oss: ``blocks`` U8 [O, I/32, 16], two e2m1 codes a
    byte, the even one low; ``scales`` U8 [O, I/32], e8m0 2^(s - 127)) as an FP4 weight of
    the same bytes, one row each. A NaN scale (0xFF) is refused."""
    blocks, scales = np.asarray(blocks, dtype=np.uint8), np.asarray(scales, dtype=np.uint8)
    if blocks.ndim != 3 or blocks.shape[2] != FP4_GROUP // 2 or scales.shape != blocks.shape[:2]:
        raise ValueError(
            f"MXFP4 blocks {blocks.shape} and scales {scales.shape} are not [O, G, 16] and [O, G]"
        )
    if (scales == 0xFF).any():
        raise ValueError("MXFP4 scale 0xFF (NaN)")
    rows, groups = scales.shape
    data = np.ascontiguousarray(blocks.reshape(rows, groups * FP4_GROUP // 2))
    return QuantWeight(
        WeightFormat.FP4, (rows, groups * FP4_GROUP), data, np.ascontiguousarray(scales), FP4_GROUP
    )


Q4_VALUES = np.arange(-8, 8, dtype=np.float32)
"""What each Q4 nibble n stands for: n - 8."""


def unpack_nibbles(packed: np.ndarray, cols: int, values: np.ndarray = Q4_VALUES) -> np.ndarray:
    """uint8 [R, ceil(I/2)] -> float32 code values [R, I], the even element in the low
    nibble; `values` is what each nibble stands for (Q4_VALUES, or FP4_VALUES)."""
    return values[nibble_codes(packed, cols)]


def _expand_scales(w: QuantWeight, scales: np.ndarray) -> np.ndarray:
    """Scales for a row block -> [R, 1] (per row) or [R, I] (grouped) float32 factors."""
    if w.fmt is WeightFormat.FP4:
        scales = fp4_scales(scales)
    if w.group_size == 0:
        return scales.reshape(-1, 1)
    return np.repeat(scales, w.group_size, axis=1)[:, : w.in_features]


def _dequantize_rows_of(w: QuantWeight, data: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
    """Dequantise already-selected rows (data/scales indexed the same way)."""
    if w.fmt is WeightFormat.F32:
        return np.asarray(data, dtype=np.float32)
    if w.fmt is WeightFormat.BF16:
        return bf16_to_f32(data)
    assert scales is not None
    if w.fmt in AFFINE_FORMATS:
        return dequantize_affine_rows(w.fmt, w.in_features, data, scales)
    if w.fmt is WeightFormat.Q8:
        q = data.astype(np.float32)
    elif w.fmt is WeightFormat.Q4:
        q = unpack_nibbles(data, w.in_features)
    elif w.fmt is WeightFormat.FP4:
        q = unpack_nibbles(data, w.in_features, FP4_VALUES)
    else:
        raise ValueError(f"cannot dequantise {w.fmt}")
    return q * _expand_scales(w, scales)


def dequantize(w: QuantWeight) -> np.ndarray:
    """Any supported weight -> float32 [O, I] (F32 comes back as-is, without a copy)."""
    if w.fmt is WeightFormat.F32:
        return np.asarray(w.data, dtype=np.float32)
    rows, cols = w.shape
    out = np.empty((rows, cols), dtype=np.float32)
    step = _row_block(cols)
    for r0 in range(0, rows, step):
        sl = slice(r0, r0 + step)
        scales = None if w.scales is None else w.scales[sl]
        out[sl] = _dequantize_rows_of(w, w.data[sl], scales)
    return out


def dequantize_rows(w: QuantWeight, rows: np.ndarray) -> np.ndarray:
    """Selected rows as float32 [len(rows), I]: an embedding lookup without
    dequantising the whole table."""
    idx = np.asarray(rows)
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError("rows must be a 1-D integer array")
    if idx.size and (idx.min() < 0 or idx.max() >= w.out_features):
        raise IndexError(f"row index out of range for {w.out_features} rows")
    scales = None if w.scales is None else w.scales[idx]
    return np.ascontiguousarray(_dequantize_rows_of(w, w.data[idx], scales), dtype=np.float32)


# ---- FP8 e4m3fn (HF block-scaled checkpoints) -------------------------------------


def _e4m3fn_table() -> np.ndarray:
    """All 256 float8_e4m3fn values: 1 sign, 4 exponent (bias 7), 3 mantissa bits;
    no infinities, 0x7F/0xFF are NaN, exponent 0 is subnormal (m/8 * 2^-6)."""
    table = np.empty(256, dtype=np.float32)
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exp = (byte >> 3) & 0x0F
        man = byte & 0x07
        if exp == 0x0F and man == 0x07:
            value = float("nan")
        elif exp == 0:
            value = sign * (man / 8.0) * 2.0**-6
        else:
            value = sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)
        table[byte] = value
    table.flags.writeable = False
    return table


E4M3FN = _e4m3fn_table()
E4M3FN_NAN = (0x7F, 0xFF)


def _e8m0_table() -> np.ndarray:
    table = np.array([2.0 ** (e - 127) for e in range(255)] + [float("nan")], dtype=np.float32)
    table.flags.writeable = False
    return table


E8M0 = _e8m0_table()


def e8m0_to_f32(raw: np.ndarray) -> np.ndarray:
    """UE8M0 scale bytes -> float32 2^(e-127); 0xFF is NaN (OCP E8M0). Exact, even for
    e == 0 (2^-127 is a float32 subnormal)."""
    return E8M0[np.asarray(raw, dtype=np.uint8)]


def dequantize_fp8_blocks(
    raw: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK
) -> np.ndarray:
    """e4m3fn bytes [O, I] times the float32 scale of each ``block`` x ``block`` tile.

    value = float32(fp8) * scale_inv[o // block, i // block], one f32 rounding, which is
    exactly what ``w.to(torch.float32) * scale`` computes. Callers check finiteness.
    """
    rows, cols = raw.shape
    out = np.empty((rows, cols), dtype=np.float32)
    for r0 in range(0, rows, block):
        tile = E4M3FN[raw[r0 : r0 + block]]
        s = np.repeat(scale_inv[r0 // block], block)[:cols]
        np.multiply(tile, s, out=out[r0 : r0 + block])
    return out


# ---- containers -------------------------------------------------------------------


def container_tensors(name: str, w: QuantWeight) -> dict[str, np.ndarray]:
    """The tensors a colibri container stores for ``w``: ``{name: U8 data, name.qs: F32}``.

    U8 data is [O, I] (Q8, int8 bytes reinterpreted), [O, ceil(I/2)] (Q4, FP4) or the
    affine blocks [O, 16|24 * ceil(I/64)] (Q2, Q3); scales are [O] (per row) or
    [O, ceil(I/gs)] (grouped), float32, FP4's e8m0 bytes [O, I/32] (stored as F8_E8M0), or
    Q2/Q3's float16 scale and minimum pairs [O, 2 * ceil(I/64)] (stored as F16). An F32
    weight is stored as itself.
    """
    if w.fmt is WeightFormat.F32:
        return {name: np.ascontiguousarray(w.data, dtype=np.float32)}
    if w.fmt in AFFINE_FORMATS and w.scales is not None:
        data = np.ascontiguousarray(w.data, dtype=np.uint8)
        return {name: data, name + ".qs": np.ascontiguousarray(w.scales, dtype=np.float16)}
    if w.fmt not in (WeightFormat.Q8, WeightFormat.Q4, WeightFormat.FP4) or w.scales is None:
        raise ValueError(f"no container encoding for {w.fmt} weight {name!r}")
    data = np.ascontiguousarray(w.data).view(np.uint8)
    if w.fmt is WeightFormat.FP4:  # MXFP4's e8m0 bytes, stored as such (F8_E8M0)
        return {name: data, name + ".qs": np.ascontiguousarray(w.scales, dtype=np.uint8)}
    return {name: data, name + ".qs": np.ascontiguousarray(w.scales, dtype=np.float32)}
