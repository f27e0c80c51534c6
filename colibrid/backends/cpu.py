"""The CPU backend: the model's ops on the native SIMD kernels (numpy arrays in and out)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from colibrid.backends import native
from colibrid.backends.base import ExpertBatch, GQAWeights, KernelFamily, RouteRule
from colibrid.formats.quant import dequantize_rows
from colibrid.formats.weights import QuantWeight


class CpuOps:
    """Implements models.base.Ops; stateless, the kernels keep their own thread pool."""

    name = "cpu"

    def matmul(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        return native.matmul(w, np.ascontiguousarray(x, dtype=np.float32), family)

    def matmul_many(
        self, weights: Sequence[QuantWeight], x: np.ndarray, family: KernelFamily
    ) -> list[np.ndarray]:
        return native.matmul_many(list(weights), np.ascontiguousarray(x, dtype=np.float32), family)

    def matmul_blocks(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        return native.matmul_blocks(w, np.ascontiguousarray(x, dtype=np.float32), family)

    def expert_swiglu(
        self,
        gate: QuantWeight,
        up: QuantWeight,
        down: QuantWeight,
        x: np.ndarray,
        family: KernelFamily,
    ) -> np.ndarray:
        return native.expert_swiglu(
            gate, up, down, np.ascontiguousarray(x, dtype=np.float32), family
        )

    def apply_experts(
        self, batch: ExpertBatch, x: np.ndarray, out: np.ndarray, family: KernelFamily
    ) -> None:
        native.apply_experts(
            batch.weights,
            batch.start,
            batch.rows,
            batch.gates,
            batch.dest,
            np.ascontiguousarray(x, dtype=np.float32),
            out,
            family,
        )

    def rank_sum(self, parts: np.ndarray) -> np.ndarray:
        return native.rank_sum(parts)

    def route(
        self, h: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, rule: RouteRule, n: int
    ) -> tuple[np.ndarray, np.ndarray]:
        f32 = np.float32
        return native.route(
            np.ascontiguousarray(h, dtype=f32),
            np.ascontiguousarray(weight, dtype=f32),
            None if bias is None else np.ascontiguousarray(bias, dtype=f32),
            rule,
            n,
        )

    def gqa_attention(
        self,
        block: GQAWeights,
        rope: tuple[np.ndarray, np.ndarray],
        x: np.ndarray,
        caches: tuple[np.ndarray, np.ndarray],
        start: int,
        scale: float,
        family: KernelFamily,
    ) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        return native.gqa_attention(block, rope, x, caches, start, scale, family)

    def rope_half(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        return native.rope_half(np.ascontiguousarray(x, dtype=np.float32), cos, sin)

    def add_rms_norm(
        self, h: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float
    ) -> tuple[np.ndarray, np.ndarray]:
        f32 = np.float32
        return native.add_rms_norm(
            np.ascontiguousarray(h, dtype=f32),
            np.ascontiguousarray(delta, dtype=f32),
            np.ascontiguousarray(weight, dtype=f32),
            eps,
        )

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        return native.rms_norm(
            np.ascontiguousarray(x, dtype=np.float32),
            np.ascontiguousarray(weight, dtype=np.float32),
            eps,
        )

    def attend_gqa(
        self, q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float, start: int
    ) -> np.ndarray:
        return native.attend_gqa(
            np.ascontiguousarray(q, dtype=np.float32), keys, values, scale, start
        )

    def embed(self, table: QuantWeight, ids: np.ndarray) -> np.ndarray:
        return dequantize_rows(table, np.asarray(ids, dtype=np.int64))
