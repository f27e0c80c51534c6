"""The cuda backend: the model's weight products on an NVIDIA GPU (native/cuda/kernels.cu
through pycuda), everything else on the CPU kernels.

What goes where, and why: the weight products (dense projections, every expert's
SwiGLU, the head) are where a token's bytes are, so they run on the device, against
weights held in VRAM by the tier (backends.cuda_weights) in the container's own format.
The router, norms, RoPE, attention over the KV cache and the rank-ordered sums are small
next to them and run on the host's native kernels, as on `--backend cpu`; numpy arrays
cross the seam as for every backend, so models and the store never see device memory.
Both kernel families. In F32 every expert is computed on the device, wherever its bytes
were (VRAM, RAM, a slab just read from disk): the same kernel on the same bytes, so
placement never changes a token; results equal the numpy reference to float tolerance.
In I8 the device reproduces the CPU kernels' integer arithmetic bit for bit
(native/src/ref/ref.c defines it; activations quantised and the SwiGLU step taken by the
same native code on the host), so an expert may be computed on either side with the same
bits: an expert the device tier does not keep is computed where its bytes are, on the
CPU, when the CPU's product beats copying it over the bus (measured once, on the first
such expert; the seed's finding for batch-1 decode), and weights whose format the device
cannot do exactly (f32/bf16 matrices, int4 groups that are not whole 32-input chunks) are
computed by the CPU kernels. Within an op the launches queue on one stream and the host
waits at the copies back. The conformance module checks both families on the device, or
on the CPU emulation of it where there is no GPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from colibrid.backends import native
from colibrid.backends.base import (
    ExpertBatch,
    KernelFamily,
)
from colibrid.backends.cpu import CpuOps
from colibrid.backends.cuda_device import Buffer, Device, copy_probe, open_device, read_probe
from colibrid.backends.cuda_weights import AFFINE_CODES, DeviceWeight, upload
from colibrid.backends.device_ops import (
    DeviceOps,
    HostRule,
    exact_integer,
    rows_of,
    sub_batch,
    timed,
)
from colibrid.backends.device_tier import DeviceTier
from colibrid.formats.weights import QuantWeight

log = logging.getLogger("colibri.backend")

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

I8_PTRS = 5
"""Addresses of one I8 product (kernels.cu I8_PTRS): the F32 four and the rows' scales."""


@dataclass(frozen=True)
class Activations:
    """A product's input rows on the device, ``width`` values a row: float32 rows at ``x``
    (F32 family), or int8 codes at ``x`` with one float scale a row at ``xs`` (I8)."""

    x: int
    width: int
    xs: int = 0

    @property
    def integer(self) -> bool:
        return self.xs != 0

    def from_row(self, r: int) -> Activations:
        """The rows from row ``r`` on."""
        if self.integer:
            return Activations(self.x + r * self.width, self.width, self.xs + r * F4)
        return Activations(self.x + r * self.width * F4, self.width)


Product = tuple[DeviceWeight, Activations, int, int]
"""One product for `_products`: the weight, its input rows, how many, y's address."""

Swiglu = tuple[DeviceWeight, DeviceWeight, DeviceWeight, Activations, int, int]
"""One SwiGLU for `_swiglus`: gate, up, down, its input rows, how many, y's address."""


def exact_on_device(w: QuantWeight) -> bool:
    """Whether the device computes ``w`` in the I8 family with the CPU kernels' bits:
    integer codes whose scale groups are whole 32-input chunks, or one group a row."""
    return exact_integer(w, CHUNK)


class CudaOps(DeviceOps):
    """Implements models.base.Ops: the CPU backend with its weight products on the device
    (the router, norms, RoPE, attention over the cache and the rank sums are CpuOps')."""

    name = "cuda"
    families = frozenset(KernelFamily)
    exact = staticmethod(exact_on_device)

    def __init__(
        self,
        device: Device | None = None,
        vram_bytes: int | None = None,
        host_experts: bool | None = None,
    ) -> None:
        """``host_experts``: in I8, compute the experts the tier does not keep on the CPU
        (True), copy them over (False), or decide by timing both on the first (None)."""
        self.device = device if device is not None else open_device()
        budget = vram_bytes
        if budget is None:
            budget = int(self.device.memory()[0] * VRAM_SHARE)
        device = self.device
        self.tier = DeviceTier(lambda w: upload(device, w), lambda d: d.nbytes, budget)
        self._scratch: dict[str, Buffer] = {}
        self._retired: list[Buffer] = []
        self._lock = threading.RLock()  # one op at a time owns the scratch buffers
        self.host = HostRule("cuda", host_experts, lambda w: timed(lambda: upload(device, w)))
        self.tier.stats.device = f"{self.device.name} (CUDA)"

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

    def _activations(self, name: str, rows: np.ndarray, family: KernelFamily) -> Activations:
        """float32 ``rows`` [S, width] on the device as ``family``'s input: as they are
        (F32), or their int8 codes and scales as the native kernels quantise them (I8)."""
        if family is KernelFamily.F32:
            return Activations(self._put(name, rows), rows.shape[1])
        q, scales = native.quant_rows(rows)
        return Activations(self._put(name, q), rows.shape[1], self._put(name + "_xs", scales))

    def _products(self, jobs: list[Product]) -> None:
        """Every y [rows, O] = x [rows, I] @ W^T of ``jobs`` in two launches (kernels.cu
        mm_partial and mm_reduce, or mm_i8_partial and mm_i8_reduce for int8 inputs); a
        product's bits do not depend on the others."""
        if not jobs:
            return
        integer = jobs[0][1].integer
        meta = np.zeros((len(jobs), JOB_INTS), dtype=np.int32)
        addresses = np.zeros((len(jobs), I8_PTRS if integer else 4), dtype=np.uint64)
        threads = outputs = partials = 0
        for j, (w, x, rows, y) in enumerate(jobs):
            if x.integer != integer:
                raise ValueError("one launch computes one kernel family")
            o, i = w.shape
            chunks = -(-i // CHUNK)
            lanes = min(MAX_LANES, max(1, chunks))
            meta[j] = (o, i, rows, lanes, w.fmt, w.group, w.groups, w.row_bytes, threads,
                       outputs, partials)  # fmt: skip
            addresses[j, :4] = (w.data, w.scales, x.x, y)
            if integer:
                addresses[j, 4] = x.xs
            threads += o * lanes
            outputs += rows * o
            # I8: an integer a chunk, two for Q2/Q3 (the dot and the sum of x's codes)
            per_chunk = 2 if w.fmt in AFFINE_CODES else 1
            partials += rows * o * (chunks * per_chunk if integer else lanes)
        part = self._space("part", partials * F4)
        meta_at, addresses_at = self._put("meta", meta), self._put("addresses", addresses)
        first, second = (
            ("mm_i8_partial", "mm_i8_reduce") if integer else ("mm_partial", "mm_reduce")
        )
        self.device.launch(first, threads, meta_at, addresses_at, len(jobs), threads, part)
        self.device.launch(second, outputs, meta_at, addresses_at, len(jobs), outputs, part)

    def _swiglus(self, jobs: list[Swiglu], meanwhile: Callable[[], None] | None = None) -> None:
        """y [rows, D] = down(silu(gate x) * up x) for every (gate, up, down, x, rows, y) of
        ``jobs``: the gates and ups in one product launch, the downs in another;
        ``meanwhile`` runs on the host while the first launch computes."""
        hidden = sum(gate.shape[0] * rows for gate, _, _, _, rows, _ in jobs)
        g, u = (self._space(n, hidden * F4) for n in ("gate", "up"))
        first: list[Product] = []
        at = 0
        for gate, up, _, x, rows, _ in jobs:
            first += [(gate, x, rows, g + at), (up, x, rows, u + at)]
            at += gate.shape[0] * rows * F4
        self._products(first)
        if meanwhile is not None:
            meanwhile()
        integer = bool(jobs) and jobs[0][3].integer
        hidden_of = self._hidden_i8 if integer else self._hidden_f32
        inputs = hidden_of(jobs, g, u, hidden)
        self._products(
            [(down, h, rows, y) for (_, _, down, _, rows, y), h in zip(jobs, inputs, strict=True)]
        )

    def _hidden_f32(self, jobs: list[Swiglu], g: int, u: int, hidden: int) -> list[Activations]:
        """silu(g) * u on the device (``hidden`` values): each job's rows as float inputs."""
        h = self._space("hidden", hidden * F4)
        self.device.launch("swiglu", hidden, g, u, h, hidden)
        inputs, at = [], h
        for gate, _, _, _, rows, _ in jobs:
            inputs.append(Activations(at, gate.shape[0]))
            at += rows * gate.shape[0] * F4
        return inputs

    def _hidden_i8(self, jobs: list[Swiglu], g: int, u: int, hidden: int) -> list[Activations]:
        """silu(g) * u on the host by the native code, each job's hidden rows quantised
        there as the CPU kernels quantise them: their bits, whatever expf the GPU has."""
        gates, ups = np.empty(hidden, dtype=np.float32), np.empty(hidden, dtype=np.float32)
        self.device.download(gates, g)
        self.device.download(ups, u)
        native.silu_mul(gates, ups)
        codes, scales, at = [], [], 0
        for gate, _, _, _, rows, _ in jobs:
            width = gate.shape[0]
            q, xs = native.quant_rows(gates[at : at + rows * width].reshape(rows, width))
            codes.append(q.reshape(-1))
            scales.append(xs)
            at += rows * width
        q_at = self._put("hidden_q", np.concatenate(codes))
        xs_at = self._put("hidden_xs", np.concatenate(scales))
        inputs, at, row = [], 0, 0
        for gate, _, _, _, rows, _ in jobs:
            inputs.append(Activations(q_at + at, gate.shape[0], xs_at + row * F4))
            at += rows * gate.shape[0]
            row += rows
        return inputs

    # ---- Ops ------------------------------------------------------------------------------

    def matmul_many(
        self, weights: Sequence[QuantWeight], x: np.ndarray, family: KernelFamily
    ) -> list[np.ndarray]:
        if not weights:
            return []
        here = self._on_device(weights, family)
        outs: list[np.ndarray | None] = [None] * len(weights)
        if not all(here):  # what the device cannot do exactly: the CPU kernels, same bits
            away = [k for k, on in enumerate(here) if not on]
            done = super().matmul_many([weights[k] for k in away], x, family)
            for k, y in zip(away, done, strict=True):
                outs[k] = y
        if any(here):
            mine = [w for w, on in zip(weights, here, strict=True) if on]
            xs = rows_of(x, weights[0].shape[1])
            lead = x.shape[:-1]
            with self._lock:
                xin = self._activations("x", xs, family)
                total = sum(w.shape[0] for w in mine) * xs.shape[0]
                yp = self._space("y", total * F4)
                jobs, at = [], yp
                for w in mine:
                    jobs.append((self.tier.get(w), xin, xs.shape[0], at))
                    at += w.shape[0] * xs.shape[0] * F4
                self._products(jobs)
                flat = self._get(yp, (total,))
            lo = 0
            for k in (k for k, on in enumerate(here) if on):
                n = weights[k].shape[0] * xs.shape[0]
                outs[k] = flat[lo : lo + n].reshape(*lead, weights[k].shape[0])
                lo += n
        return [y for y in outs if y is not None]

    def matmul_blocks(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        if family is KernelFamily.I8:
            return super().matmul_blocks(w, x, family)  # small per-head blocks, same bits
        if x.ndim not in (2, 3):
            raise ValueError("x must be a 2-D [B, I] or 3-D [S, B, I] numpy array")
        x3 = x.reshape(1, *x.shape) if x.ndim == 2 else x
        rows, count = x3.shape[0], x3.shape[1]
        width = w.shape[0] // count
        if width * count != w.shape[0]:
            raise ValueError(f"{w.shape[0]} output rows do not split into {count} equal blocks")
        with self._lock:
            dw = self.tier.get(w)
            blocks = np.ascontiguousarray(x3.transpose(1, 0, 2), dtype=np.float32)
            xin = Activations(self._put("x", blocks), w.shape[1])
            yp = self._space("y", count * rows * width * F4)
            self._products(
                [
                    (dw.rows(b * width, (b + 1) * width), xin.from_row(b * rows), rows,
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
        if not all(self._on_device((gate, up, down), family)):
            return super().expert_swiglu(gate, up, down, x, family)
        xs = rows_of(x, gate.shape[1])
        with self._lock:
            xin = self._activations("x", xs, family)
            yp = self._space("y", xs.shape[0] * down.shape[0] * F4)
            gate_d, up_d, down_d = (self.tier.get(w) for w in (gate, up, down))
            self._swiglus([(gate_d, up_d, down_d, xin, xs.shape[0], yp)])
            y = self._get(yp, (xs.shape[0], down.shape[0]))
        return y.reshape(*x.shape[:-1], down.shape[0])

    def apply_experts(
        self, batch: ExpertBatch, x: np.ndarray, out: np.ndarray, family: KernelFamily
    ) -> None:
        """F32: every expert's rows gathered, computed and gated on the device, one copy
        back, one scatter into out. I8: the experts the device computes exactly and the
        tier keeps (or that cost less to copy than to compute here) on the device, the
        rest by the CPU kernels meanwhile, with the same bits either way."""
        if len(batch.rows) == 0:
            return
        if family is KernelFamily.F32:
            self._apply_experts_f32(batch, x, out)
            return
        self._apply_experts_i8(batch, x, out)

    def _apply_experts_i8(self, batch: ExpertBatch, x: np.ndarray, out: np.ndarray) -> None:
        xs = rows_of(x, x.shape[-1])
        width = xs.shape[1]
        with self._lock:
            used = [e for e in range(len(batch.weights)) if batch.start[e] < batch.start[e + 1]]
            placed = {e: self._place_expert(batch.weights[e]) for e in used}
            host = [e for e in used if placed[e] is None]
            self.tier.stats.host_experts += len(host)

            def on_the_host() -> None:
                if host:
                    CpuOps.apply_experts(self, sub_batch(batch, host), x, out, KernelFamily.I8)

            mine = [e for e in used if placed[e] is not None]
            if not mine:
                on_the_host()
                return
            pairs = [p for e in mine for p in range(batch.start[e], batch.start[e + 1])]
            xin = self._activations("x", xs[[batch.rows[p] for p in pairs]], KernelFamily.I8)
            yp = self._space("y", len(pairs) * width * F4)
            jobs: list[Swiglu] = []
            at = 0
            for e in mine:
                n = batch.start[e + 1] - batch.start[e]
                gate, up, down = placed[e]  # type: ignore[misc]
                jobs.append((gate, up, down, xin.from_row(at), n, yp + at * width * F4))
                at += n
            self._swiglus(jobs, meanwhile=on_the_host)
            ys = self._get(yp, (len(pairs), width))
        gates = np.asarray([batch.gates[p] for p in pairs], dtype=np.float32)
        out[[batch.dest[p] for p in pairs]] = ys * gates[:, None]  # as C: y times the gate

    def _apply_experts_f32(self, batch: ExpertBatch, x: np.ndarray, out: np.ndarray) -> None:
        pairs = len(batch.rows)
        xs = rows_of(x, x.shape[-1])
        width = xs.shape[1]
        with self._lock:
            xp = self._put("x", xs)
            rows = self._put("rows", np.asarray(batch.rows, dtype=np.int32))
            gates = self._put("gates", np.asarray(batch.gates, dtype=np.float32))
            gathered = self._space("gathered", pairs * width * F4)
            self.device.launch("gather_rows", pairs * width, xp, width, rows, pairs, gathered)
            yp = self._space("y", pairs * width * F4)
            xin = Activations(gathered, width)
            jobs: list[Swiglu] = []
            for e, w in enumerate(batch.weights):
                lo, hi = batch.start[e], batch.start[e + 1]
                if lo < hi:
                    gate, up, down = (self.tier.get(m, expert=True) for m in (w.gate, w.up, w.down))
                    jobs.append((gate, up, down, xin.from_row(lo), hi - lo, yp + lo * width * F4))
            self._swiglus(jobs)
            self.device.launch("scale_rows", pairs * width, yp, width, gates, pairs)
            ys = self._get(yp, (pairs, width))
        out[np.asarray(batch.dest, dtype=np.int64)] = ys

    def limits(self, nbytes: int = 256 << 20) -> tuple[float, str]:
        """The device's read probe (GB/s) measured now over ``nbytes``, and a line saying it
        and the host-to-device copy rate: what the benches print their figures beside."""
        read, copy = read_probe(self.device, nbytes), copy_probe(self.device, nbytes)
        line = f"{self.device.name}: read probe {read:.1f} GB/s, host to device {copy:.1f} GB/s"
        return read, line
