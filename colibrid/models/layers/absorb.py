"""MLA weight absorption on kv_b_proj as the checkpoint stores it (int8/int4/bf16/f32).

Absorbed attention needs, per head h, q_nope[h] @ W_k[h] (W_k: [N, C], a product along
the rows of the stored matrix) and o_latent[h] @ W_v[h]^T (a plain matvec). Keeping a
float copy of kv_b costs 4x its int8 bytes (3.4 GB more on GLM-5) and reads as much per
token, so both products run on the kernels in the stored codes instead:

- W_v's rows are the checkpoint's rows: gathered per head, one block-diagonal matmul.
- W_k is transposed code for code (lossless: no requantisation) into rows over C with a
  unit scale; its per-(row, group) scales multiply the query instead, group by group, so
  a block of output rows shares one scaled query. ``q_nope * s`` rounds in a different
  order than ``s * code``; it is float reassociation within the F32 family's tolerance.

Shapes: H heads, N qk_nope_head_dim, V v_head_dim, C kv_lora_rank, S rows, G groups of
the stored rows over C.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibrid.backends.base import KernelFamily
from colibrid.formats.quant import dequantize, nibble_codes, pack_codes
from colibrid.formats.weights import QuantWeight, WeightFormat
from colibrid.models.base import Ops


@dataclass(frozen=True)
class KeyAbsorb:
    """W_k transposed: rows (h, c) over N; block (h, g) shares the query scaled by
    ``scales[h, g]`` ([H, G, N]; None when the stored format has no scales)."""

    weight: QuantWeight  # [H * C, N]
    scales: np.ndarray | None  # [H, G, N]
    heads: int
    groups: int

    def __call__(self, ops: Ops, q_nope: np.ndarray, family: KernelFamily) -> np.ndarray:
        """q_nope [S, H, N] -> q_latent [S, H, C]."""
        rows = q_nope.shape[0]
        if self.scales is None:
            x = q_nope
        else:  # [S, H, 1, N] * [H, G, N] -> one query per block (h, g)
            x = (q_nope[:, :, None, :] * self.scales[None]).reshape(rows, -1, q_nope.shape[2])
        y = ops.matmul_blocks(self.weight, np.ascontiguousarray(x, dtype=np.float32), family)
        return y.reshape(rows, self.heads, -1)


def split_kv_b(w: QuantWeight, heads: int, nope: int, v: int) -> tuple[KeyAbsorb, QuantWeight]:
    """(W_k absorbed, W_v [H * V, C]) from kv_b_proj [H * (N + V), C].

    Int4 groups that do not tile C exactly (a ragged last group) cannot share one query
    per block: such a weight is expanded to float once, as the fallback. The rest is
    bulk array moves of the stored codes (no per-element Python, no float detour): on
    GLM-5's shape (64 heads, N 192, V 256, C 512, int4-g64) 20 ms a layer at load instead
    of 65."""
    c = w.shape[1]
    if w.scales is None and w.data.size and not any(w.data.strides):
        # One value everywhere (the zero-stride placeholders `engine.validate` walks the
        # model with): every split and transposition of it is itself, so no copies.
        one = w.data.reshape(-1)[:1]
        k = QuantWeight(w.fmt, (heads * c, nope), np.broadcast_to(one, (heads * c, nope)))
        v_rows = QuantWeight(w.fmt, (heads * v, c), np.broadcast_to(one, (heads * v, c)))
        return KeyAbsorb(k, None, heads, 1), v_rows
    if w.fmt == WeightFormat.Q4 and w.group_size and c % w.group_size:
        w = QuantWeight(WeightFormat.F32, w.shape, dequantize(w))
    w_k = _head_rows(w, heads, nope + v, 0, nope)
    w_v = _head_rows(w, heads, nope + v, nope, nope + v)
    return _transpose_keys(w_k, heads, nope, c), w_v


def _head_rows(w: QuantWeight, heads: int, per_head: int, lo: int, hi: int) -> QuantWeight:
    """Rows lo..hi of every head's block of ``per_head`` rows, heads in order."""

    def take(a: np.ndarray) -> np.ndarray:
        block = a.reshape(heads, per_head, *a.shape[1:])[:, lo:hi]
        return np.ascontiguousarray(block).reshape(heads * (hi - lo), *a.shape[1:])

    scales = None if w.scales is None else take(w.scales)
    return QuantWeight(w.fmt, (heads * (hi - lo), w.shape[1]), take(w.data), scales, w.group_size)


def _transpose_keys(wk: QuantWeight, heads: int, nope: int, c: int) -> KeyAbsorb:
    q4 = wk.fmt == WeightFormat.Q4
    codes = nibble_codes(wk.data, c) if q4 else wk.data  # [H * N, C]
    t = np.ascontiguousarray(
        codes.reshape(heads, nope, c).transpose(0, 2, 1).reshape(heads * c, nope)
    )
    shape = (heads * c, nope)
    if wk.scales is None:  # F32 / BF16: nothing to move onto the query
        return KeyAbsorb(QuantWeight(wk.fmt, shape, t), None, heads, 1)
    scales = wk.scales.reshape(heads, nope, -1)  # one group per row unless grouped Q4
    weight = QuantWeight(
        wk.fmt, shape, pack_codes(t) if q4 else t, np.ones(heads * c, dtype=np.float32)
    )
    block_scales = np.ascontiguousarray(scales.transpose(0, 2, 1), dtype=np.float32)
    return KeyAbsorb(weight, block_scales, heads, scales.shape[2])
