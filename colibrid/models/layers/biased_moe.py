"""The MoE block of gpt-oss: experts with biases on all three projections and a clamped
SwiGLU, ``(clip(up, ±limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``.

Why a block of its own: the backends' fused expert kernels compute the plain SwiGLU
without biases. Here each expert is three matmuls through the declared `Ops` (so every
backend and kernel family serves it) with the biases (resident, [E, F] and [E, D] per
layer: small next to the expert matrices the store streams) and the activation in numpy.
Routing, fetching and the per-row sum in ascending expert order are the MoE block's, so
placement still never changes a token.

Shape legend: S rows, D hidden, F expert FFN width, K experts per token, E experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibrid.backends.base import KernelFamily
from colibrid.backends.moe_plan import plan_rows
from colibrid.models.base import ExpertSource, Ops
from colibrid.models.layers.moe import MoE
from colibrid.models.layers.router import Router


@dataclass(frozen=True)
class ClampedGLU:
    """gpt-oss's activation constants (`swiglu_alpha`, `swiglu_limit`)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """As transformers' GptOssExperts._apply_gate, in float32."""
        limit = np.float32(self.limit)
        gate = np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
        with np.errstate(over="ignore"):  # exp(-alpha g) -> inf for g << 0: sigmoid 0
            sigmoid = np.float32(1) / (np.float32(1) + np.exp(-(gate * np.float32(self.alpha))))
        return (up + np.float32(1)) * (gate * sigmoid)


@dataclass(frozen=True)
class ExpertBiases:
    """A layer's expert biases: gate and up [E, F], down [E, D]."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


class BiasedMoE(MoE):
    def __init__(
        self,
        layer: int,
        router: Router,
        experts: ExpertSource,
        ops: Ops,
        biases: ExpertBiases,
        glu: ClampedGLU,
    ) -> None:
        super().__init__(layer, router, experts, ops, None)
        self.fused = False  # biased experts and a clamped GLU: its own combine below
        self.biases = biases
        self.glu = glu

    def combine(
        self,
        x: np.ndarray,
        ids: list[list[int]],
        gates: list[list[float]],
        groups: Iterable[list[tuple[int, Any]]],
        family: KernelFamily,
    ) -> np.ndarray:
        """Each expert on the rows that chose it, as it arrives; each (row, slot) lands at
        the expert's rank in its row, and the ranks are summed in order."""
        rows, top_k = len(ids), len(ids[0])
        plan = plan_rows(ids)
        parts = np.empty((rows * top_k, x.shape[1]), dtype=np.float32)  # [S * K, D]
        b = self.biases
        for group in groups:
            for expert, w in group:
                row_idx, slot_idx, rank_idx = plan[expert]
                xs = np.ascontiguousarray(x[row_idx])
                g, u = self.ops.matmul_many([w.gate, w.up], xs, family)  # [n, F] each
                h = self.glu(g + b.gate[expert], u + b.up[expert])
                y = self.ops.matmul(w.down, np.ascontiguousarray(h), family)  # [n, D]
                y += b.down[expert]
                y *= np.array(
                    [gates[r][s] for r, s in zip(row_idx, slot_idx, strict=True)], dtype=np.float32
                )[:, None]
                parts[[r * top_k + k for r, k in zip(row_idx, rank_idx, strict=True)]] = y
        return self.ops.rank_sum(parts.reshape(rows, top_k, x.shape[1]))
