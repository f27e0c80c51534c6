"""The CPU backend: the model's ops on the native SIMD kernels (numpy arrays in and out)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from colibrid.backends import calibrate, native
from colibrid.backends.base import (
    DeviceTierStats,
    ExpertBatch,
    GQAWeights,
    KernelFamily,
    ResidentExperts,
    RouteRule,
    SwiGLUWeights,
)
from colibrid.formats.quant import dequantize_rows
from colibrid.formats.weights import QuantWeight, WeightLayout


def _f32(a: np.ndarray) -> np.ndarray:
    """``a`` as the kernels take it: float32, C-contiguous (no copy when it already is)."""
    return np.ascontiguousarray(a, dtype=np.float32)


class CpuOps:
    """Implements models.base.Ops; stateless, the kernels keep their own thread pool."""

    name = "cpu"
    families = frozenset(KernelFamily)

    def prepare(self, layouts: Mapping[WeightLayout, int]) -> None:
        calibrate.tune(layouts)

    def matmul(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        return native.matmul(w, _f32(x), family)

    def matmul_many(
        self, weights: Sequence[QuantWeight], x: np.ndarray, family: KernelFamily
    ) -> list[np.ndarray]:
        return native.matmul_many(list(weights), _f32(x), family)

    def matmul_blocks(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        return native.matmul_blocks(w, _f32(x), family)

    def expert_swiglu(
        self,
        gate: QuantWeight,
        up: QuantWeight,
        down: QuantWeight,
        x: np.ndarray,
        family: KernelFamily,
    ) -> np.ndarray:
        return native.expert_swiglu(gate, up, down, _f32(x), family)

    def apply_experts(
        self, batch: ExpertBatch, x: np.ndarray, out: np.ndarray, family: KernelFamily
    ) -> None:
        native.apply_experts(
            batch.weights,
            batch.start,
            batch.rows,
            batch.gates,
            batch.dest,
            _f32(x),
            out,
            family,
        )

    def rank_sum(self, parts: np.ndarray) -> np.ndarray:
        return native.rank_sum(parts)

    def moe(
        self,
        x: np.ndarray,
        weight: np.ndarray,
        bias: np.ndarray | None,
        rule: RouteRule,
        layer: ResidentExperts,
        shared: SwiGLUWeights | None,
        family: KernelFamily,
    ) -> tuple[np.ndarray, np.ndarray]:
        return native.moe(
            _f32(x), _f32(weight), None if bias is None else _f32(bias), rule, layer, shared, family
        )

    def route(
        self, h: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, rule: RouteRule, n: int
    ) -> tuple[np.ndarray, np.ndarray]:
        return native.route(_f32(h), _f32(weight), None if bias is None else _f32(bias), rule, n)

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
        return native.gqa_attention(block, rope, _f32(x), caches, start, scale, family)

    def rope_half(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        return native.rope_half(_f32(x), cos, sin)

    def add_rms_norm(
        self, h: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float
    ) -> tuple[np.ndarray, np.ndarray]:
        return native.add_rms_norm(_f32(h), _f32(delta), _f32(weight), eps)

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        return native.rms_norm(
            _f32(x),
            _f32(weight),
            eps,
        )

    def attend_gqa(
        self,
        q: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        scale: float,
        start: int,
        window: int | None = None,
        sinks: np.ndarray | None = None,
    ) -> np.ndarray:
        return native.attend_gqa(_f32(q), keys, values, scale, start, window, sinks)

    def embed(self, table: QuantWeight, ids: np.ndarray) -> np.ndarray:
        return dequantize_rows(table, np.asarray(ids, dtype=np.int64))

    def device_tier(self) -> DeviceTierStats | None:
        return None

    def promote(self, experts: Sequence[SwiGLUWeights]) -> int:
        return 0
