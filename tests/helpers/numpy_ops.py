"""A plain-numpy implementation of the model ops, the arithmetic reference for the kernels.

Weights are dequantised with the converter's reference maths and multiplied in float64,
so an engine built on these ops computes the same function as the native F32 family up to
float rounding. Tests use it to tell kernel problems from model problems.
"""

from __future__ import annotations

import numpy as np

from colibrid.backends.base import ExpertBatch, KernelFamily
from colibrid.backends.gqa_plan import gqa_attention_each
from colibrid.backends.moe_plan import moe_each
from colibrid.formats.quant import dequantize, dequantize_rows
from colibrid.formats.weights import QuantWeight
from colibrid.models.base import apply_experts_each, rank_sum_each
from colibrid.models.layers.attention import causal_mask, masked_softmax
from colibrid.models.layers.norm import rms_norm
from colibrid.models.layers.rope import apply_half
from colibrid.models.layers.router import route_reference
from colibrid.models.layers.sinks import attend_with_sinks


class NumpyOps:
    name = "numpy"
    families = frozenset(KernelFamily)  # it computes f32 whatever is asked (a reference)

    def __init__(self) -> None:
        self._cache: dict[int, np.ndarray] = {}

    def prepare(self, layouts) -> None:  # noqa: ANN001
        """Nothing to tune: numpy has one way to multiply."""

    def device_tier(self) -> None:
        return None

    def promote(self, experts) -> int:  # noqa: ANN001
        return 0

    def _dense(self, w: QuantWeight) -> np.ndarray:
        key = id(w.data)
        if key not in self._cache:
            self._cache[key] = dequantize(w).astype(np.float64)
        return self._cache[key]

    def matmul(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        return (x.astype(np.float64) @ self._dense(w).T).astype(np.float32)

    def matmul_many(self, weights, x, family):  # noqa: ANN001, ANN201
        return [self.matmul(w, x, family) for w in weights]

    def expert_swiglu(
        self,
        gate: QuantWeight,
        up: QuantWeight,
        down: QuantWeight,
        x: np.ndarray,
        family: KernelFamily,
    ) -> np.ndarray:
        g = self.matmul(gate, x, family)
        u = self.matmul(up, x, family)
        h = (g / (1.0 + np.exp(-g))) * u
        return self.matmul(down, h.astype(np.float32), family)

    def apply_experts(
        self, batch: ExpertBatch, x: np.ndarray, out: np.ndarray, family: KernelFamily
    ) -> None:
        apply_experts_each(self, batch, x, out, family)

    def rank_sum(self, parts: np.ndarray) -> np.ndarray:
        return rank_sum_each(parts)

    def moe(self, x, weight, bias, rule, layer, shared, family):  # noqa: ANN001, ANN201
        return moe_each(self, x, weight, bias, rule, layer, shared, family)

    def route(self, h, weight, bias, rule, n):  # noqa: ANN001, ANN201
        return route_reference(h, weight, bias, rule, n)

    def gqa_attention(self, *args):  # noqa: ANN002, ANN201
        return gqa_attention_each(self, *args)

    def rope_half(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        return apply_half(x, cos, sin)

    def add_rms_norm(self, h, delta, weight, eps):  # noqa: ANN001, ANN201
        total = h + delta
        return total, rms_norm(total, weight, eps)

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        return rms_norm(x, weight, eps)

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
        """Grouped-query attention in numpy: the KV heads' query heads stacked as rows of
        one batched matmul (the engine's own path before the native kernel); with sinks,
        the rule of layers.sinks."""
        if sinks is not None:
            return attend_with_sinks(q, keys, values, sinks, scale, start, window)
        rows, heads, d = q.shape
        kv_heads = keys.shape[1]
        group = heads // kv_heads
        q_g = q.transpose(1, 0, 2).reshape(kv_heads, group * rows, d)
        scores = np.matmul(q_g, keys.transpose(1, 2, 0)) * np.float32(scale)
        scores = scores.reshape(heads, rows, keys.shape[0])
        probs = masked_softmax(scores, causal_mask(start, rows, keys.shape[0], window))
        out = np.matmul(probs.reshape(kv_heads, group * rows, -1), values.transpose(1, 0, 2))
        return np.ascontiguousarray(out.reshape(heads, rows, d).transpose(1, 0, 2)).reshape(
            rows, heads * d
        )

    def embed(self, table: QuantWeight, ids: np.ndarray) -> np.ndarray:
        return dequantize_rows(table, np.asarray(ids, dtype=np.int64))
