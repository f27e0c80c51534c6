"""The cuda backend: the model's weight products on an NVIDIA GPU (native/cuda/kernels.cu
through pycuda), everything else on the CPU kernels.

What goes where, and why: the weight products (dense projections, every expert's
SwiGLU, the head) are where a token's bytes are, so they run on the device, against
weights held in VRAM by the tier (backends.cuda_weights) in the container's own format.
The router, norms, RoPE, attention over the KV cache and the rank-ordered sums are small
next to them and run on the host's native kernels, as on `--backend cpu`; numpy arrays
cross the seam as for every backend, so models and the store never see device memory.
Every expert is computed on the device, wherever its bytes were (VRAM, RAM, a slab just
read from disk): the same kernel on the same bytes, so placement never changes a token.

Only the F32 kernel family is computed (I8's bit-exact integer contract belongs to the CPU
kernels). Within an op the launches queue on one stream and the host waits once, at the
copy back. Results equal the numpy reference to float tolerance, which the conformance
module checks on the device, or on the CPU emulation of it where there is no GPU.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from colibrid.backends.base import (
    DeviceTierStats,
    ExpertBatch,
    GQAWeights,
    KernelFamily,
    ResidentExperts,
    RouteRule,
    SwiGLUWeights,
    require_f32,
)
from colibrid.backends.cpu import CpuOps
from colibrid.backends.cuda_device import Buffer, Device, copy_probe, open_device, read_probe
from colibrid.backends.cuda_weights import DeviceWeight, upload
from colibrid.backends.device_tier import DeviceTier
from colibrid.backends.gqa_plan import gqa_attention_each
from colibrid.backends.moe_plan import moe_each
from colibrid.formats.weights import QuantWeight, WeightLayout

CHUNK = 32
"""Inputs a kernel thread reads at a time (kernels.cu CHUNK)."""

MAX_LANES = 32
"""Threads sharing one output row: a warp reading the row's chunks side by side."""

VRAM_SHARE = 0.8
"""Of the device memory free at start, the share the weight tier may fill by default; the
rest is left to the scratch buffers and other programs."""

F4 = 4  # bytes of a float32

JOB_INTS = 11
"""Integers describing one product to kernels.cu's mm_partial / mm_reduce (J_* there)."""

Product = tuple[DeviceWeight, int, int, int]
"""One product for `_products`: the weight, x's address, its rows, y's address."""

Swiglu = tuple[QuantWeight, QuantWeight, QuantWeight, int, int, int]
"""One SwiGLU for `_swiglus`: gate, up, down, x's address, its rows, y's address."""


def _family(family: KernelFamily) -> None:
    require_f32("cuda", family)


def _rows(x: np.ndarray, width: int) -> np.ndarray:
    """x as float32 C-contiguous [S, width]."""
    if x.shape[-1] != width:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {width}")
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1, width)


class CudaOps(CpuOps):
    """Implements models.base.Ops: the CPU backend with its weight products on the device
    (the router, norms, RoPE, attention over the cache and the rank sums are CpuOps')."""

    name = "cuda"
    families = frozenset({KernelFamily.F32})

    def __init__(self, device: Device | None = None, vram_bytes: int | None = None) -> None:
        self.device = device if device is not None else open_device()
        budget = vram_bytes
        if budget is None:
            budget = int(self.device.memory()[0] * VRAM_SHARE)
        device = self.device
        self.tier = DeviceTier(lambda w: upload(device, w), lambda d: d.nbytes, budget)
        self._scratch: dict[str, Buffer] = {}
        self._retired: list[Buffer] = []
        self._lock = threading.RLock()  # one op at a time owns the scratch buffers

    # ---- device plumbing ------------------------------------------------------------------
    def _space(self, name: str, nbytes: int) -> int:
        """Scratch buffer ``name`` of at least ``nbytes``; a buffer outgrown mid-op is kept
        until the op ends, as queued launches may still read it."""
        held = self._scratch.get(name)
        if held is None or held.nbytes < nbytes:
            if held is not None:
                self._retired.append(held)
            size = max(nbytes, 2 * held.nbytes if held is not None else 0)
            held = self.tier.with_room(lambda: self.device.alloc(size), f"{size >> 20} MiB of work")
            self._scratch[name] = held
        return held.ptr

    def _put(self, name: str, host: np.ndarray) -> int:
        ptr = self._space(name, host.nbytes)
        self.device.upload(ptr, host)
        return ptr

    def _get(self, ptr: int, shape: tuple[int, ...]) -> np.ndarray:
        """Copy back (the host waits here for the op's launches), then end the op."""
        out = np.empty(shape, dtype=np.float32)
        self.device.download(out, ptr)
        self._retired.clear()
        return out

    def _products(self, jobs: list[Product]) -> None:
        """Every y [rows, O] = x [rows, I] @ W^T of ``jobs`` in two launches (kernels.cu
        mm_partial, mm_reduce); a product's bits do not depend on the others."""
        if not jobs:
            return
        meta = np.zeros((len(jobs), JOB_INTS), dtype=np.int32)
        addresses = np.zeros((len(jobs), 4), dtype=np.uint64)
        threads = outputs = partials = 0
        for j, (w, x, rows, y) in enumerate(jobs):
            o, i = w.shape
            lanes = min(MAX_LANES, max(1, -(-i // CHUNK)))
            meta[j] = (o, i, rows, lanes, w.fmt, w.group, w.groups, w.row_bytes, threads,
                       outputs, partials)  # fmt: skip
            addresses[j] = (w.data, w.scales, x, y)
            threads, outputs, partials = (
                threads + o * lanes,
                outputs + rows * o,
                partials + rows * o * lanes,
            )
        part = self._space("part", partials * F4)
        meta_at, addresses_at = self._put("meta", meta), self._put("addresses", addresses)
        self.device.launch("mm_partial", threads, meta_at, addresses_at, len(jobs), threads, part)
        self.device.launch("mm_reduce", outputs, meta_at, addresses_at, len(jobs), outputs, part)

    def _swiglus(self, jobs: list[Swiglu], expert: bool) -> None:
        """y [rows, D] = down(silu(gate x) * up x) for every (gate, up, down, x, rows, y) of
        ``jobs`` (device addresses): the gates and ups in one product launch, one silu
        over all of them, the downs in another."""
        hidden = sum(gate.shape[0] * rows for gate, _, _, _, rows, _ in jobs)
        g, u, h = (self._space(n, hidden * F4) for n in ("gate", "up", "hidden"))
        first: list[Product] = []
        second: list[Product] = []
        at = 0
        for gate, up, down, x, rows, y in jobs:
            dg, du, dd = (self.tier.get(w, expert) for w in (gate, up, down))
            first += [(dg, x, rows, g + at), (du, x, rows, u + at)]
            second.append((dd, h + at, rows, y))
            at += gate.shape[0] * rows * F4
        self._products(first)
        self.device.launch("swiglu", hidden, g, u, h, hidden)
        self._products(second)

    # ---- Ops ------------------------------------------------------------------------------
    def prepare(self, layouts: Mapping[WeightLayout, int]) -> None:
        """Nothing to tune: one kernel serves every layout."""

    def matmul(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        return self.matmul_many([w], x, family)[0]

    def matmul_many(
        self, weights: Sequence[QuantWeight], x: np.ndarray, family: KernelFamily
    ) -> list[np.ndarray]:
        _family(family)
        if not weights:
            return []
        width = weights[0].shape[1]
        xs = _rows(x, width)
        lead = x.shape[:-1]
        with self._lock:
            xp = self._put("x", xs)
            total = sum(w.shape[0] for w in weights) * xs.shape[0]
            yp = self._space("y", total * F4)
            jobs, at = [], yp
            for w in weights:
                jobs.append((self.tier.get(w), xp, xs.shape[0], at))
                at += w.shape[0] * xs.shape[0] * F4
            self._products(jobs)
            flat = self._get(yp, (total,))
        outs, lo = [], 0
        for w in weights:
            n = w.shape[0] * xs.shape[0]
            outs.append(flat[lo : lo + n].reshape(*lead, w.shape[0]))
            lo += n
        return outs

    def matmul_blocks(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        _family(family)
        if x.ndim not in (2, 3):
            raise ValueError("x must be a 2-D [B, I] or 3-D [S, B, I] numpy array")
        x3 = x.reshape(1, *x.shape) if x.ndim == 2 else x
        rows, count = x3.shape[0], x3.shape[1]
        width = w.shape[0] // count
        if width * count != w.shape[0]:
            raise ValueError(f"{w.shape[0]} output rows do not split into {count} equal blocks")
        with self._lock:
            dw = self.tier.get(w)
            xp = self._put("x", np.ascontiguousarray(x3.transpose(1, 0, 2), dtype=np.float32))
            yp = self._space("y", count * rows * width * F4)
            self._products(
                [
                    (dw.rows(b * width, (b + 1) * width), xp + b * rows * w.shape[1] * F4, rows,
                     yp + b * rows * width * F4)
                    for b in range(count)
                ]
            )  # fmt: skip
            y = self._get(yp, (count, rows, width))
        out = np.ascontiguousarray(y.transpose(1, 0, 2)).reshape(rows, count * width)
        return out[0] if x.ndim == 2 else out

    def expert_swiglu(
        self,
        gate: QuantWeight,
        up: QuantWeight,
        down: QuantWeight,
        x: np.ndarray,
        family: KernelFamily,
    ) -> np.ndarray:
        _family(family)
        xs = _rows(x, gate.shape[1])
        with self._lock:
            xp = self._put("x", xs)
            yp = self._space("y", xs.shape[0] * down.shape[0] * F4)
            self._swiglus([(gate, up, down, xp, xs.shape[0], yp)], expert=False)
            y = self._get(yp, (xs.shape[0], down.shape[0]))
        return y.reshape(*x.shape[:-1], down.shape[0])

    def apply_experts(
        self, batch: ExpertBatch, x: np.ndarray, out: np.ndarray, family: KernelFamily
    ) -> None:
        """Every expert's rows gathered, computed and gated on the device, one copy back,
        one scatter into out: as apply_experts_each, row for row."""
        _family(family)
        pairs = len(batch.rows)
        if pairs == 0:
            return
        xs = _rows(x, x.shape[-1])
        width = xs.shape[1]
        with self._lock:
            xp = self._put("x", xs)
            rows = self._put("rows", np.asarray(batch.rows, dtype=np.int32))
            gates = self._put("gates", np.asarray(batch.gates, dtype=np.float32))
            gathered = self._space("gathered", pairs * width * F4)
            self.device.launch("gather_rows", pairs * width, xp, width, rows, pairs, gathered)
            yp = self._space("y", pairs * width * F4)
            jobs: list[Swiglu] = []
            for e, w in enumerate(batch.weights):
                lo, hi = batch.start[e], batch.start[e + 1]
                if lo < hi:
                    offset = lo * width * F4
                    jobs.append((w.gate, w.up, w.down, gathered + offset, hi - lo, yp + offset))
            self._swiglus(jobs, expert=True)
            self.device.launch("scale_rows", pairs * width, yp, width, gates, pairs)
            ys = self._get(yp, (pairs, width))
        out[np.asarray(batch.dest, dtype=np.int64)] = ys

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
        """Routed on the host, the experts in one apply_experts on the device (moe_each)."""
        _family(family)
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
        _family(family)
        return gqa_attention_each(self, block, rope, x, caches, start, scale, family)

    def limits(self, nbytes: int = 256 << 20) -> tuple[float, str]:
        """The device's read probe (GB/s) measured now over ``nbytes``, and a line saying it
        and the host-to-device copy rate: what the benches print their figures beside."""
        read, copy = read_probe(self.device, nbytes), copy_probe(self.device, nbytes)
        line = f"{self.device.name}: read probe {read:.1f} GB/s, host to device {copy:.1f} GB/s"
        return read, line

    def device_tier(self) -> DeviceTierStats | None:
        return dataclasses.replace(self.tier.stats)
