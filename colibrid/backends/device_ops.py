"""What the device backends (cuda, webgpu) share: `DeviceOps`, the CPU backend with its
weight products on a device of its own (the router, norms, RoPE, attention over the
cache and the rank sums stay CpuOps'), and the decisions they take the same way: which
weights a device can compute in the I8 family with the CPU kernels' bits, where an I8
expert the device tier does not keep is computed, and the sub-batch left to the host.

Both devices compute integer dots over 32-input chunks and then the CPU's float steps per
scale group, so a weight is exact on them when its codes are integers (int8, int4, FP4,
the low-bit affine Q2/Q3, whose groups of 64 are two chunks each) and no chunk crosses a
scale group: groups of whole chunks, or one group a row.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from colibrid.backends.base import (
    DeviceTierStats,
    ExpertBatch,
    GQAWeights,
    KernelFamily,
    ResidentExperts,
    RouteRule,
    SwiGLUWeights,
)
from colibrid.backends.cpu import CpuOps
from colibrid.backends.device_tier import DeviceTier
from colibrid.backends.gqa_plan import gqa_attention_each
from colibrid.backends.moe_plan import moe_each
from colibrid.formats.weights import QuantWeight, WeightFormat, WeightLayout

log = logging.getLogger("colibri.backend")

INTEGER_FORMATS = (
    WeightFormat.Q8,
    WeightFormat.Q4,
    WeightFormat.FP4,
    WeightFormat.Q2,
    WeightFormat.Q3,
)


def exact_integer(w: QuantWeight, chunk: int) -> bool:
    """Whether ``w``'s I8 product by ``chunk``-input integer dots gives the CPU kernels'
    bits: integer codes whose scale groups are whole chunks, or one group a row."""
    if w.fmt not in INTEGER_FORMATS:
        return False
    group, width = w.group_size, w.shape[1]
    return w.fmt is WeightFormat.Q8 or group <= 0 or group >= width or group % chunk == 0


def sub_batch(batch: ExpertBatch, experts: Sequence[int]) -> ExpertBatch:
    """The pairs of ``experts`` only, as a batch of their own (same rows, gates, dests)."""
    weights, start, rows, gates, dest = [], [0], [], [], []
    for e in experts:
        lo, hi = batch.start[e], batch.start[e + 1]
        weights.append(batch.weights[e])
        rows += batch.rows[lo:hi]
        gates += batch.gates[lo:hi]
        dest += batch.dest[lo:hi]
        start.append(len(rows))
    return ExpertBatch(weights, start, rows, gates, dest)


def timed(run: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


class HostRule:
    """Where an I8 expert the device tier does not keep is computed: on the CPU, where its
    bytes are, when the CPU's product of one of its weights takes less time than copying
    that weight to the device (the seed's finding for batch-1 decode), else copied over.
    ``fixed`` decides it outright (True: the CPU); None times both once, on the first such
    weight, and says what it found in the tier's statistics and the log."""

    def __init__(
        self, backend: str, fixed: bool | None, copy_s: Callable[[QuantWeight], float]
    ) -> None:
        self.backend = backend
        self.fixed = fixed
        self._copy_s = copy_s

    def beats_bus(self, cpu: CpuOps, w: QuantWeight, stats: DeviceTierStats) -> bool:
        """Whether ``w``'s expert goes to the host; ``cpu`` is the CpuOps that computes it."""
        if self.fixed is None:
            x = np.ones((1, w.shape[1]), dtype=np.float32)
            compute = min(
                timed(lambda: CpuOps.matmul(cpu, w, x, KernelFamily.I8)) for _ in range(3)
            )
            copy = min(self._copy_s(w) for _ in range(3))
            self.fixed = compute < copy
            where = "computed on the cpu" if self.fixed else "copied to the device"
            stats.host_rule = (
                f"i8 experts the tier does not keep are {where} (the cpu's product of a "
                f"{w.nbytes / 1e6:.2f} MB expert weight {compute * 1e3:.2f} ms, its copy "
                f"{copy * 1e3:.2f} ms)"
            )
            log.info("%s: %s", self.backend, stats.host_rule)
        return self.fixed


def rows_of(x: np.ndarray, width: int) -> np.ndarray:
    """x as float32 C-contiguous [S, width]."""
    if x.shape[-1] != width:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {width}")
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1, width)


def matrices(w: SwiGLUWeights) -> tuple[QuantWeight, QuantWeight, QuantWeight]:
    return w.gate, w.up, w.down


class DeviceOps(CpuOps):
    """Implements models.base.Ops for a backend with a device of its own: its weight
    products (the subclass's matmul_many, matmul_blocks, expert_swiglu, apply_experts)
    on the device against the copies ``tier`` holds, everything else on the CPU kernels.
    A subclass sets ``tier``, ``host`` (its HostRule) and ``exact`` (the weights it
    computes in I8 with the CPU kernels' bits)."""

    tier: DeviceTier[Any]
    host: HostRule

    @staticmethod
    def exact(w: QuantWeight) -> bool:  # pragma: no cover - every subclass sets its own
        raise NotImplementedError

    def _on_device(self, weights: Sequence[QuantWeight], family: KernelFamily) -> list[bool]:
        """Which of ``weights`` the device computes in ``family`` (F32: all)."""
        return [family is KernelFamily.F32 or self.exact(w) for w in weights]

    def _place_expert(self, w: SwiGLUWeights) -> tuple[Any, Any, Any] | None:
        """An I8 expert's device copies, or None: it is computed on the host (a format the
        device cannot do exactly, or copies the tier would not keep, where the CPU's
        product is faster than the copy)."""
        mats = matrices(w)
        if not all(self.exact(m) for m in mats):
            return None
        kept = [self.tier.keep(m) for m in mats]
        if None in kept and self.host.beats_bus(self, w.gate, self.tier.stats):
            return None
        gate, up, down = (
            k if k is not None else self.tier.copy_once(m) for k, m in zip(kept, mats, strict=True)
        )
        return gate, up, down

    def prepare(self, layouts: Mapping[WeightLayout, int]) -> None:
        """Nothing to tune: one kernel serves every layout."""

    def matmul(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        return self.matmul_many([w], x, family)[0]

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
        """Routed on the host, the experts in one apply_experts (moe_each)."""
        return moe_each(self, x, weight, bias, rule, layer, shared, family)

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
        """Projections on the device, the rest on the host: gqa_attention_each itself."""
        return gqa_attention_each(self, block, rope, x, caches, start, scale, family)

    def device_tier(self) -> DeviceTierStats | None:
        return dataclasses.replace(self.tier.stats)

    def promote(self, experts: Sequence[SwiGLUWeights]) -> int:
        return self.tier.promote([m for e in experts for m in matrices(e)])
