"""A colibri matrix as GGUF block bytes: the same codes, re-encoded without requantising.

Why each mapping (GGUF's block types are llama.cpp's; each stores 32 weights a block):

* int4 (nibble = q + 8, f32 scale per group of 64 or per row) -> Q4_0: a block is an f16
  scale and 16 bytes whose low nibbles are weights 0..15 and high nibbles 16..31, each
  ``n - 8``: the same codes, the scale rounded to f16 (the one rounding of the export).
* int8 rows -> Q8_0: 32 int8 codes and an f16 scale, the row's scale in every block.
* MXFP4 as stored (e2m1 codes, an e8m0 byte per 32) -> MXFP4: the same byte and codes,
  bit for bit (GGUF reads a code as the doubled e2m1 value times 2^(e - 128), as colibri).
* Q2/Q3 affine (unsigned codes, f16 scale and minimum per 64) -> Q4_1 (f16 ``d`` and
  ``m``, 4-bit codes, ``w = d * q + m``): the same codes, scale and minimum, bit for bit.
* A tensor whose experts mix formats takes the one type every member maps to exactly:
  int4 with Q2/Q3 -> Q4_1 (int4's ``s * (n - 8)`` is ``s * n + (-8 s)``), int4 with int8
  -> Q8_0 (the int4 codes are int8 codes of the same scale).
* f32 stays f32 and bf16 stays bf16. A matrix no block type holds exactly (a row that is
  not a multiple of 32, a scale beyond f16, a mix with no common type) is written as its
  f32 values: exact, bigger, and reported (``Encoding.fallback``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from colibrid.formats import quant
from colibrid.formats.affine import AFFINE_GROUP, affine_groups, unpack_affine
from colibrid.formats.weights import AFFINE_FORMATS, QuantWeight, WeightFormat

BLOCK = 32
F16_MAX = 65504.0


@dataclass(frozen=True)
class Encoding:
    """The GGUF type a tensor is written in (a ``gguf.GGMLQuantizationType`` name) and why
    it fell back to f32 when it did (None when the stored format maps directly)."""

    ggml: str
    fallback: str | None = None


def _common_type(formats: set[WeightFormat]) -> str | None:
    if formats == {WeightFormat.F32}:
        return "F32"
    if formats == {WeightFormat.BF16}:
        return "BF16"
    if formats == {WeightFormat.Q4}:
        return "Q4_0"
    if formats == {WeightFormat.Q8} or formats == {WeightFormat.Q4, WeightFormat.Q8}:
        return "Q8_0"
    if formats == {WeightFormat.FP4}:
        return "MXFP4"
    if formats and formats <= {WeightFormat.Q4, *AFFINE_FORMATS}:
        return "Q4_1"
    return None


def _scales_fit(w: QuantWeight) -> bool:
    if w.scales is None or w.fmt is WeightFormat.FP4:
        return True
    s = np.abs(np.asarray(w.scales, dtype=np.float32))
    if w.fmt is WeightFormat.Q4:
        s = s * 8  # Q4_1's minimum is -8 s
    return bool(np.all(s <= F16_MAX))


def choose(weights: Iterable[QuantWeight]) -> Encoding:
    """The one GGUF type for these matrices (a 2-D weight, or a layer's experts stacked)."""
    ws = list(weights)
    formats = {w.fmt for w in ws}
    ggml = _common_type(formats)
    names = ", ".join(sorted(f.value for f in formats))
    if ggml is None:
        return Encoding("F32", f"formats {names} have no common GGUF block type")
    if ggml not in ("F32", "BF16"):
        i = ws[0].in_features
        if i % BLOCK:
            return Encoding("F32", f"rows of {i} weights are not whole blocks of {BLOCK}")
        if ggml == "Q4_1" and i % AFFINE_GROUP and formats & AFFINE_FORMATS:
            return Encoding("F32", f"rows of {i} weights are not whole affine groups")
        if not all(_scales_fit(w) for w in ws):
            return Encoding("F32", "a scale beyond float16's range")
    return Encoding(ggml)


def _block_scales(w: QuantWeight) -> np.ndarray:
    """The f32 scale of each 32-weight block of each row: [O, I / 32]."""
    o, i = w.shape
    s = np.asarray(w.scales, dtype=np.float32).reshape(o, -1)
    if s.shape[1] == 1:
        return np.repeat(s, i // BLOCK, axis=1)
    group = w.group_size if 0 < w.group_size < i else i
    return s[:, (np.arange(i // BLOCK) * BLOCK) // group]


def _codes(w: QuantWeight) -> np.ndarray:
    """Unsigned 4-bit codes [O, I] of a nibble format (int4: q + 8; FP4: the e2m1 code)."""
    o, i = w.shape
    packed = np.asarray(w.data).reshape(o, i // 2)
    codes = np.empty((o, i), dtype=np.uint8)
    codes[:, 0::2] = packed & 15
    codes[:, 1::2] = packed >> 4
    return codes


def _nibble_blocks(codes: np.ndarray) -> np.ndarray:
    """[O, I] codes 0..15 -> [O, I / 32, 16]: weight j of a block low, j + 16 high."""
    o, i = codes.shape
    b = codes.reshape(o, i // BLOCK, BLOCK)
    return b[:, :, :16] | (b[:, :, 16:] << 4)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """[O, B] values -> [O, B, 2] little-endian float16 bytes."""
    o, b = x.shape
    return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(o, b, 2)


def _q4_0(w: QuantWeight) -> np.ndarray:
    o, i = w.shape
    d = _f16_bytes(_block_scales(w))
    return np.concatenate([d, _nibble_blocks(_codes(w))], axis=2).reshape(o, i // BLOCK * 18)


def _q8_0(w: QuantWeight) -> np.ndarray:
    o, i = w.shape
    if w.fmt is WeightFormat.Q4:
        codes = (_codes(w).astype(np.int16) - 8).astype(np.int8)
    else:
        codes = np.asarray(w.data).view(np.int8).reshape(o, i)
    d = _f16_bytes(_block_scales(w))
    q = codes.view(np.uint8).reshape(o, i // BLOCK, BLOCK)
    return np.concatenate([d, q], axis=2).reshape(o, i // BLOCK * 34)


def _mxfp4(w: QuantWeight) -> np.ndarray:
    o, i = w.shape
    e = np.asarray(w.scales, dtype=np.uint8).reshape(o, i // BLOCK, 1)
    return np.concatenate([e, _nibble_blocks(_codes(w))], axis=2).reshape(o, i // BLOCK * 17)


def _q4_1(w: QuantWeight) -> np.ndarray:
    o, i = w.shape
    if w.fmt is WeightFormat.Q4:
        s = _block_scales(w)
        d, m, codes = s, -8.0 * s, _codes(w)
    else:
        sm = np.asarray(w.scales, dtype=np.float16).reshape(o, affine_groups(i), 2)
        pick = (np.arange(i // BLOCK) * BLOCK) // AFFINE_GROUP
        d, m = sm[:, pick, 0], sm[:, pick, 1]
        codes = unpack_affine(np.asarray(w.data), w.fmt, i)
    head = np.concatenate([_f16_bytes(d), _f16_bytes(m)], axis=2)
    return np.concatenate([head, _nibble_blocks(codes)], axis=2).reshape(o, i // BLOCK * 20)


_ENCODERS = {"Q4_0": _q4_0, "Q8_0": _q8_0, "MXFP4": _mxfp4, "Q4_1": _q4_1}


def encode(w: QuantWeight, ggml: str) -> np.ndarray:
    """The bytes (or values, for F32/BF16) of ``w`` in the GGUF type ``ggml`` that
    :func:`choose` picked for it."""
    if ggml == "F32":
        return np.ascontiguousarray(quant.dequantize(w), dtype=np.float32)
    if ggml == "BF16":
        return np.ascontiguousarray(np.asarray(w.data).view(np.uint16))
    return _ENCODERS[ggml](w)
