"""The CPU backend: the model's ops on the native SIMD kernels (numpy arrays in and out)."""

from __future__ import annotations

import numpy as np

from colibrid.backends import native
from colibrid.backends.base import KernelFamily
from colibrid.formats.quant import dequantize_rows
from colibrid.formats.weights import QuantWeight


class CpuOps:
    """Implements models.base.Ops; stateless, the kernels keep their own thread pool."""

    name = "cpu"

    def matmul(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        return native.matmul(w, np.ascontiguousarray(x, dtype=np.float32), family)

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

    def attend_gqa(
        self, q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float, start: int
    ) -> np.ndarray:
        return native.attend_gqa(
            np.ascontiguousarray(q, dtype=np.float32), keys, values, scale, start
        )

    def embed(self, table: QuantWeight, ids: np.ndarray) -> np.ndarray:
        return dequantize_rows(table, np.asarray(ids, dtype=np.int64))
