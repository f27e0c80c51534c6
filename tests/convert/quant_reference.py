"""The independent numpy maths of docs/formats.md the converter tests check against (kept out of
conftest.py so test modules import it by a name no other folder's conftest shadows)."""

from __future__ import annotations

import numpy as np
import tiny_models
import torch

ARCH = "glm_moe_dsa"
EXACT_FLAGS = [
    "--io-bits",
    "32",
    "--attn-bits",
    "32",
    "--dense-bits",
    "32",
    "--shared-bits",
    "32",
    "--mtp-bits",
    "8",
    "--quiet",
]
"""Everything but routed experts kept f32, so the reference needs no other transform."""


# ---- independent numpy implementation of docs/formats.md ---------------------------------


def ref_quant(w: np.ndarray, bits: int, gs: int) -> tuple[np.ndarray, np.ndarray]:
    """(stored U8 bytes [O, ...], scales) written from the spec, whole-tensor at once."""
    w = np.asarray(w, dtype=np.float32)
    o, i = w.shape
    qmax, qmin = (127, -128) if bits == 8 else (7, -8)
    g = i if (gs == 0 or bits == 8) else gs
    ng = -(-i // g)
    pad = np.zeros((o, ng * g), np.float32)
    pad[:, :i] = w
    blocks = pad.reshape(o, ng, g)
    s = np.maximum(np.abs(blocks).max(axis=2) / np.float32(qmax), np.float32(1e-8))
    s = s.astype(np.float32)
    q = np.clip(np.rint(blocks / s[:, :, None]), qmin, qmax).reshape(o, ng * g)[:, :i]
    q = q.astype(np.int8)
    scales = s if (bits == 4 and gs) else s.reshape(o)
    if bits == 8:
        return q.view(np.uint8), scales
    nib = np.full((o, i + (i % 2)), 8, np.uint8)
    nib[:, :i] = (q + 8).astype(np.uint8)
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8), scales


def ref_dequant(
    data: np.ndarray, scales: np.ndarray, shape: tuple[int, int], bits: int, gs: int
) -> np.ndarray:
    o, i = shape
    if bits == 8:
        q = data.view(np.int8).astype(np.float32)
    else:
        q = np.empty((o, 2 * data.shape[1]), np.float32)
        q[:, 0::2] = (data & 15).astype(np.float32) - 8
        q[:, 1::2] = (data >> 4).astype(np.float32) - 8
        q = q[:, :i]
    if bits == 4 and gs:
        return q * np.repeat(scales, gs, axis=1)[:, :i]
    return q * scales.reshape(o, 1)


def int4_roundtrip(w: np.ndarray) -> np.ndarray:
    data, s = ref_quant(w, 4, 64)
    return ref_dequant(data, s, w.shape, 4, 64).astype(np.float32)


# ---- source encodings --------------------------------------------------------------


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def nvfp4_encode(w: np.ndarray) -> dict[str, object]:
    """A modelopt-style NVFP4 encoding of ``w`` (accuracy irrelevant, determinism not)."""
    o, i = w.shape
    glob = np.float32(np.abs(w).max() / (6.0 * 448.0))
    blocks = w.reshape(o, i // 16, 16)
    bs = np.abs(blocks).max(axis=2) / 6.0 / glob
    scale_f8 = torch.from_numpy(bs.astype(np.float32)).to(torch.float8_e4m3fn)
    s = scale_f8.float().numpy()
    denom = np.repeat(np.where(s > 0, s, 1), 16, axis=1) * glob
    target = w / denom
    codes = np.abs(target[..., None] - E2M1[None, None, :8]).argmin(axis=-1)
    codes = codes + 8 * (target < 0)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return {
        "weight": packed,
        "weight_scale": scale_f8,
        "weight_scale_2": torch.tensor(glob, dtype=torch.float32),
    }


def nvfp4_decode(enc: dict[str, object]) -> np.ndarray:
    packed = enc["weight"]
    s = enc["weight_scale"].float().numpy()  # type: ignore[union-attr]
    glob = np.float32(enc["weight_scale_2"].item())  # type: ignore[union-attr]
    vals = np.empty((packed.shape[0], 2 * packed.shape[1]), np.float32)
    vals[:, 0::2] = E2M1[packed & 15]
    vals[:, 1::2] = E2M1[packed >> 4]
    out = vals * np.repeat(s, 16, axis=1)
    return out * glob


def encoding(dtype: str):  # type: ignore[no-untyped-def]
    """(expert_container, decode) for a source encoding of routed experts."""
    if dtype == "f32":
        return (lambda n, w: {n: w}), (lambda w: w)
    if dtype == "bf16":

        def enc(n, w):
            return {n: torch.from_numpy(w).to(torch.bfloat16)}

        return enc, lambda w: torch.from_numpy(w).to(torch.bfloat16).float().numpy()
    if dtype == "fp8":

        def enc(n, w):
            q, s = tiny_models.fp8_quantize(torch.from_numpy(w))
            return {n: q, n + "_scale_inv": s}

        def dec(w):
            q, s = tiny_models.fp8_quantize(torch.from_numpy(w))
            return tiny_models.fp8_dequantize(q, s).numpy()

        return enc, dec
    if dtype == "nvfp4":

        def enc(n, w):
            e = nvfp4_encode(w)
            return {
                n: e["weight"],
                n + "_scale": e["weight_scale"],
                n + "_scale_2": e["weight_scale_2"],
                n[: -len("weight")] + "input_scale": torch.tensor(1.0),
            }

        return enc, lambda w: nvfp4_decode(nvfp4_encode(w))
    raise ValueError(dtype)
