"""A plain-numpy implementation of the model ops, the arithmetic reference for the kernels.

Weights are dequantised with the converter's reference maths and multiplied in float64,
so an engine built on these ops computes the same function as the native F32 family up to
float rounding. Tests use it to tell kernel problems from model problems.
"""

from __future__ import annotations

import numpy as np

from colibrid.backends.base import KernelFamily
from colibrid.formats.quant import dequantize, dequantize_rows
from colibrid.formats.weights import QuantWeight


class NumpyOps:
    name = "numpy"

    def __init__(self) -> None:
        self._cache: dict[int, np.ndarray] = {}

    def _dense(self, w: QuantWeight) -> np.ndarray:
        key = id(w.data)
        if key not in self._cache:
            self._cache[key] = dequantize(w).astype(np.float64)
        return self._cache[key]

    def matmul(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        return (x.astype(np.float64) @ self._dense(w).T).astype(np.float32)

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

    def embed(self, table: QuantWeight, ids: np.ndarray) -> np.ndarray:
        return dequantize_rows(table, np.asarray(ids, dtype=np.int64))
