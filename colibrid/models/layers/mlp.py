"""Dense SwiGLU MLP (dense layers and shared experts), computed by the fused expert kernel."""

from __future__ import annotations

import numpy as np

from colibrid.backends.base import KernelFamily
from colibrid.models.base import Ops, WeightSource


class MLP:
    """down(silu(gate x) * up x) with resident weights."""

    def __init__(self, src: WeightSource, ops: Ops, prefix: str, hidden: int, width: int) -> None:
        self.gate = src.weight(f"{prefix}.gate_proj.weight", (width, hidden))
        self.up = src.weight(f"{prefix}.up_proj.weight", (width, hidden))
        self.down = src.weight(f"{prefix}.down_proj.weight", (hidden, width))
        self.ops = ops

    def __call__(self, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        return self.ops.expert_swiglu(self.gate, self.up, self.down, x, family)
