"""The webgpu backend: the model's weight products on any WebGPU adapter (a GPU of any
vendor through Vulkan, Metal or DX12; Mesa's lavapipe on a machine without one),
everything else on the CPU kernels.

The split is the cuda backend's (backends/cuda.py), for the same reasons: the weight
products (dense projections, every expert's SwiGLU, the head) are where a token's bytes
are, so they run on the device against weights the device tier holds in their container
format (backends.webgpu_weights); the router, norms, RoPE, attention over the KV cache and
the rank-ordered sums run on the host's native kernels. Both kernel families:

* F32: every weight is computed on the device, wherever its bytes were (device memory, RAM,
  a slab just read from disk): the same kernel on the same bytes, so placement never
  changes a token; results equal the numpy reference to float tolerance. An expert's
  SwiGLU (gate, up, silu(gate) * up, down) is one submission.
* I8: the device reproduces the CPU kernels' integer arithmetic bit for bit
  (native/webgpu/kernels.wgsl mm_i8; the activations quantised and the SwiGLU step taken
  by the same native code on the host), so an expert may be computed on either side with
  the same bits: one the tier does not keep is computed where its bytes are, on the CPU,
  when the CPU's product beats copying it (backends.device_ops.HostRule), and weights the
  device cannot compute exactly (f32/bf16 matrices, scale groups that are not whole
  32-input chunks) are computed by the CPU kernels.

The device tier is the one cuda and mlx use (backends.device_tier: dense weights kept,
experts by heat). WebGPU does not report how much memory an adapter has, so its budget
is `vram_gb` (default DEFAULT_VRAM_GB).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from colibrid.backends import native
from colibrid.backends.base import (
    DeviceTierStats,
    ExpertBatch,
    KernelFamily,
)
from colibrid.backends.cpu import CpuOps
from colibrid.backends.device_ops import (
    DeviceOps,
    HostRule,
    exact_integer,
    matrices,
    rows_of,
    sub_batch,
    timed,
)
from colibrid.backends.device_tier import DeviceTier
from colibrid.backends.webgpu_device import (
    MAX_GROUPS_X,
    Commands,
    GpuDevice,
    open_device,
    read_probe,
    upload_probe,
)
from colibrid.backends.webgpu_weights import GpuWeight, upload
from colibrid.formats.weights import AFFINE_FORMATS, QuantWeight

log = logging.getLogger("colibri.backend")

CHUNK = 32
"""Inputs of one integer chunk dot (kernels.wgsl CHUNK): I8 codes rows are padded to it."""

LANES = 64
"""Output rows a workgroup of mm_f32 / mm_i8 computes (kernels.wgsl LANES), one an
invocation; mm_*_rows compute one row a workgroup."""

GMAX = 512
"""Scale groups a row mm_i8_rows holds (kernels.wgsl GMAX)."""

DEFAULT_VRAM_GB = 2.0
"""The device tier's budget when `vram_gb` is not set (WebGPU reports no memory size)."""

F4 = 4  # bytes of a float32


def exact_on_device(w: QuantWeight) -> bool:
    """Whether the device computes ``w`` in the I8 family with the CPU kernels' bits
    (whichever kernel layout the adapter runs: at most GMAX scale groups a row, GMAX / 2
    for Q2/Q3, whose sums of the activation codes take a second run of mm_i8_rows' slots)."""
    if not exact_integer(w, CHUNK):
        return False
    group = w.group_size
    most = GMAX // 2 if w.fmt in AFFINE_FORMATS else GMAX
    return group <= 0 or group >= w.shape[1] or -(-w.shape[1] // group) <= most


@dataclasses.dataclass(frozen=True)
class Rows:
    """A product's input rows on the device: ``buffer`` from word ``base``, ``ldx`` words a
    row; in I8 int8 codes (four a word, rows padded to whole chunks) with one scale a row
    in ``scales`` from float ``xs_base``."""

    buffer: Any
    base: int
    ldx: int
    scales: Any = None
    xs_base: int = 0

    def from_row(self, r: int) -> Rows:
        return Rows(self.buffer, self.base + r * self.ldx, self.ldx, self.scales, self.xs_base + r)


class WebgpuOps(DeviceOps):
    """Implements models.base.Ops: the CPU backend with its weight products on a WebGPU
    device (the router, norms, RoPE, attention over the cache and the rank sums are
    CpuOps')."""

    name = "webgpu"
    families = frozenset(KernelFamily)
    exact = staticmethod(exact_on_device)

    def __init__(
        self,
        device: GpuDevice | None = None,
        vram_bytes: int | None = None,
        host_experts: bool | None = None,
    ) -> None:
        """``host_experts``: in I8, compute the experts the tier does not keep on the CPU
        (True), copy them over (False), or decide by timing both on the first (None)."""
        self.device = device if device is not None else open_device()
        budget = vram_bytes if vram_bytes is not None else int(DEFAULT_VRAM_GB * (1 << 30))
        gpu = self.device
        self.tier: DeviceTier[GpuWeight] = DeviceTier(
            lambda w: upload(gpu, w), lambda d: d.nbytes, budget
        )
        self.host = HostRule("webgpu", host_experts, self._device_product_s)
        self._scratch: dict[str, Any] = {}
        self._sizes: dict[str, int] = {}
        self._epoch = 0  # bumped when a scratch buffer is replaced (bind groups name them)

    # ---- device plumbing ------------------------------------------------------------------
    def _space(self, name: str, nbytes: int) -> Any:
        """Scratch buffer ``name`` of at least ``nbytes`` (kept between ops, grown by
        doubling; every bind group naming the old one is outdated then)."""
        if self._sizes.get(name, -1) < nbytes:
            size = max(nbytes, 2 * self._sizes.get(name, 0), 1024)
            self._scratch[name] = self.tier.with_room(
                lambda: self.device.storage(size), f"{size >> 20} MiB of work"
            )
            self._sizes[name] = size
            self._epoch += 1
        return self._scratch[name]

    def _put(self, name: str, host: np.ndarray) -> Any:
        buffer = self._space(name, host.nbytes)
        self.device.write(buffer, host)
        return buffer

    def _activations(self, name: str, rows: np.ndarray, family: KernelFamily) -> Rows:
        """float32 ``rows`` [S, width] on the device as ``family``'s input: as they are
        (F32), or their int8 codes (rows padded to whole chunks) and scales as the native
        kernels quantise them (I8)."""
        width = rows.shape[1]
        if family is KernelFamily.F32:
            return Rows(self._put(name, rows), 0, width)
        q, scales = native.quant_rows(rows)
        padded = -(-width // CHUNK) * CHUNK
        codes = np.zeros((rows.shape[0], padded), dtype=np.int8)
        codes[:, :width] = q
        return Rows(self._put(name, codes), 0, padded // 4, self._put(name + "_xs", scales))

    def _bound(self, gw: GpuWeight, k: int, integer: bool, x: Rows, y: Any) -> Any:
        """The bind group of piece ``k`` of ``gw`` with these scratch buffers (made once)."""
        key = (k, integer, id(x.buffer), id(x.scales), id(y), self._epoch)
        group = gw.bound.get(key)
        if group is None:
            if len(gw.bound) > 16:  # outdated ones (an earlier epoch)
                gw.bound.clear()
            piece = gw.pieces[k]
            kernel = self.device.kernel("mm_i8" if integer else "mm_f32", FMT=gw.fmt)  # its layout
            dummy = self.device.dummy
            buffers = (
                piece.data,
                piece.scales if piece.scales is not None else dummy,
                x.buffer,
                x.scales if x.scales is not None else dummy,
                y,
            )
            group = gw.bound[key] = self.device.bind(kernel, buffers)
        return group

    def _product(
        self,
        commands: Commands,
        gw: GpuWeight,
        x: Rows,
        rows: int,
        y: Any,
        y_base: int,
        o_total: int,
        o_base: int = 0,
        lo: int = 0,
        hi: int | None = None,
    ) -> None:
        """y[y_base + s * o_total + o_base + (o - lo)] = (x @ W^T)[s, o] for weight rows o
        in [lo, hi) and the ``rows`` rows of x: one dispatch per piece of the weight."""
        hi = gw.shape[0] if hi is None else hi
        integer = x.scales is not None
        name = ("mm_i8" if integer else "mm_f32") + ("_rows" if self.device.cooperative else "")
        kernel = self.device.kernel(name, FMT=gw.fmt, TILE=1 if rows == 1 else 4)
        for k, piece in enumerate(gw.pieces):
            start, end = max(lo, piece.row0), min(hi, piece.row0 + piece.rows)
            if start >= end:
                continue
            n = end - start
            groups = n if self.device.cooperative else -(-n // LANES)
            params = (n, gw.shape[1], rows, gw.fmt, gw.group, gw.groups, gw.row_bytes,
                      start - piece.row0, o_base + start - lo, o_total, x.base, x.ldx, y_base,
                      x.xs_base, min(groups, MAX_GROUPS_X), 0)  # fmt: skip
            commands.add(kernel, self._bound(gw, k, integer, x, y), params, groups)

    def _read(self, commands: Commands, y: Any, shape: tuple[int, ...]) -> np.ndarray:
        """Run ``commands`` and copy y [shape] back (the host waits here)."""
        data = self.device.run(commands, y, int(np.prod(shape)) * F4)
        return np.frombuffer(data, dtype=np.float32).reshape(shape).copy()

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
        mine = [k for k, on in enumerate(here) if on]
        if mine:
            xs = rows_of(x, weights[0].shape[1])
            rows = xs.shape[0]
            total = sum(weights[k].shape[0] for k in mine)
            with self.device.lock:
                xin = self._activations("x", xs, family)
                y = self._space("y", rows * total * F4)
                commands, at = Commands(), 0
                for k in mine:
                    gw = self.tier.get(weights[k])
                    self._product(commands, gw, xin, rows, y, at * rows, gw.shape[0])
                    at += gw.shape[0]
                flat = self._read(commands, y, (rows * total,))
            lo = 0
            for k in mine:
                n = weights[k].shape[0] * rows
                outs[k] = flat[lo : lo + n].reshape(*x.shape[:-1], weights[k].shape[0])
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
        blocks = np.ascontiguousarray(x3.transpose(1, 0, 2), dtype=np.float32)  # [B, S, I]
        with self.device.lock:
            gw = self.tier.get(w)
            xin = self._activations("x", blocks.reshape(count * rows, w.shape[1]), family)
            y = self._space("y", rows * w.shape[0] * F4)
            commands = Commands()
            for b in range(count):  # block b: its rows of W times x[:, b], into y [S, O]
                self._product(commands, gw, xin.from_row(b * rows), rows, y, 0, w.shape[0],
                              b * width, b * width, (b + 1) * width)  # fmt: skip
            out = self._read(commands, y, (rows, w.shape[0]))
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
        batch = ExpertBatch([_Expert(gate, up, down)], [0, xs.shape[0]],
                            list(range(xs.shape[0])), [1.0] * xs.shape[0],
                            list(range(xs.shape[0])))  # fmt: skip
        with self.device.lock:
            ys = self._swiglus(batch, [0], xs, family, lambda w: self.tier.get(w))
        return ys.reshape(*x.shape[:-1], down.shape[0])

    def _swiglus(
        self,
        batch: ExpertBatch,
        experts: Sequence[int],
        x: np.ndarray,
        family: KernelFamily,
        place: Any,
        meanwhile: Any = None,
    ) -> np.ndarray:
        """down(silu(gate x) * up x) of each of ``experts`` of ``batch`` on its rows of x,
        in pair order: [pairs, D] ungated. ``place`` gives a weight's device copy;
        ``meanwhile`` runs on the host while the device computes the gates and ups."""
        pairs = [p for e in experts for p in range(batch.start[e], batch.start[e + 1])]
        gathered = x[[batch.rows[p] for p in pairs]]
        width = x.shape[1]
        hidden = sum(batch.weights[e].gate.shape[0] * (batch.start[e + 1] - batch.start[e])
                     for e in experts)  # fmt: skip
        xin = self._activations("x", gathered, family)
        g, u = self._space("g", hidden * F4), self._space("u", hidden * F4)
        y = self._space("y", len(pairs) * width * F4)
        mats = [(place(batch.weights[e].gate), place(batch.weights[e].up),
                 place(batch.weights[e].down)) for e in experts]  # fmt: skip
        first, at, row = Commands(), 0, 0
        for e, (gate, up, _) in zip(experts, mats, strict=True):
            n = batch.start[e + 1] - batch.start[e]
            f = gate.shape[0]
            self._product(first, gate, xin.from_row(row), n, g, at, f)
            self._product(first, up, xin.from_row(row), n, u, at, f)
            at, row = at + n * f, row + n
        if family is KernelFamily.F32:  # silu(g) * u on the device too: one submission
            h = self._space("h", hidden * F4)
            swiglu = self.device.kernel("swiglu")
            blocks = -(-hidden // 256)
            first.add(swiglu, self.device.bind(swiglu, (g, u, h)),
                      (hidden, 0, 0, 0, min(blocks, MAX_GROUPS_X)), blocks)  # fmt: skip
            inputs = self._hidden_rows(h, experts, batch, None)
        else:  # the native SwiGLU step and quantisation on the host: the CPU's bits
            self.device.run(first)
            if meanwhile is not None:
                meanwhile()
            first = Commands()
            gates = np.frombuffer(self._fetch(g, hidden), dtype=np.float32).copy()
            ups = np.frombuffer(self._fetch(u, hidden), dtype=np.float32)
            native.silu_mul(gates, np.ascontiguousarray(ups))
            inputs = self._hidden_rows(None, experts, batch, gates)
        row = 0
        for e, (_, _, down), h_rows in zip(experts, mats, inputs, strict=True):
            n = batch.start[e + 1] - batch.start[e]
            self._product(first, down, h_rows, n, y, row * width, width)
            row += n
        return self._read(first, y, (len(pairs), width))

    def _hidden_rows(
        self, h: Any, experts: Sequence[int], batch: ExpertBatch, values: np.ndarray | None
    ) -> list[Rows]:
        """Each expert's hidden rows as the input of its down product: the device's h
        (F32), or ``values`` quantised row by row as the native kernels do (I8)."""
        inputs, at = [], 0
        if values is None:
            for e in experts:
                f = batch.weights[e].gate.shape[0]
                inputs.append(Rows(h, at, f))
                at += f * (batch.start[e + 1] - batch.start[e])
            return inputs
        codes, scales = [], []
        for e in experts:
            f, n = batch.weights[e].gate.shape[0], batch.start[e + 1] - batch.start[e]
            q, xs = native.quant_rows(values[at : at + n * f].reshape(n, f))
            padded = np.zeros((n, -(-f // CHUNK) * CHUNK), dtype=np.int8)
            padded[:, :f] = q
            codes.append(padded.reshape(-1))
            scales.append(xs)
            at += n * f
        q_buf = self._put("hidden_q", np.concatenate(codes))
        xs_buf = self._put("hidden_xs", np.concatenate(scales))
        word, row = 0, 0
        for e, c in zip(experts, codes, strict=True):
            n = batch.start[e + 1] - batch.start[e]
            ldx = c.size // n // 4
            inputs.append(Rows(q_buf, word, ldx, xs_buf, row))
            word, row = word + c.size // 4, row + n
        return inputs

    def _fetch(self, buffer: Any, count: int) -> bytes:
        return self.device.run(Commands(), buffer, count * F4)

    def apply_experts(
        self, batch: ExpertBatch, x: np.ndarray, out: np.ndarray, family: KernelFamily
    ) -> None:
        """F32: every expert on the device, one submission, its rows gated and scattered on
        the host. I8: the experts the device computes exactly and the tier keeps (or that
        cost less to copy than to compute here) on the device, the rest by the CPU kernels
        meanwhile, with the same bits either way."""
        if len(batch.rows) == 0:
            return
        xs = rows_of(x, x.shape[-1])
        used = [e for e in range(len(batch.weights)) if batch.start[e] < batch.start[e + 1]]
        with self.device.lock:
            if family is KernelFamily.F32:
                mine, host = used, []
                place = lambda w: self.tier.get(w, expert=True)  # noqa: E731
            else:
                placed = {e: self._place_expert(batch.weights[e]) for e in used}
                mine = [e for e in used if placed[e] is not None]
                host = [e for e in used if placed[e] is None]
                self.tier.stats.host_experts += len(host)
                copies = {
                    id(m): d
                    for e in mine
                    for m, d in zip(matrices(batch.weights[e]), placed[e], strict=True)
                }  # type: ignore[arg-type]
                place = lambda w: copies[id(w)]  # noqa: E731

            def on_the_host() -> None:
                if host:
                    CpuOps.apply_experts(self, sub_batch(batch, host), x, out, family)

            if not mine:
                on_the_host()
                return
            ys = self._swiglus(batch, mine, xs, family, place, on_the_host)
        pairs = [p for e in mine for p in range(batch.start[e], batch.start[e + 1])]
        gates = np.asarray([batch.gates[p] for p in pairs], dtype=np.float32)
        out[[batch.dest[p] for p in pairs]] = ys * gates[:, None]  # as C: y times the gate
        if family is KernelFamily.F32 and host:  # pragma: no cover - F32 keeps none on the host
            on_the_host()

    def _device_product_s(self, w: QuantWeight) -> float:
        """Seconds to copy ``w`` to the device (what computing a passed-through expert
        there costs before its product)."""
        return timed(lambda: upload(self.device, w))

    def limits(self, nbytes: int = 256 << 20) -> tuple[float, str]:
        """The device's read probe (GB/s) measured now over ``nbytes``, and a line saying it
        and the host-to-device copy rate: what the benches print their figures beside."""
        with self.device.lock:
            read, copy = read_probe(self.device, nbytes), upload_probe(self.device, nbytes)
        cpu = " (a CPU adapter: these are CPU figures)" if self.device.adapter.kind == "CPU" else ""
        line = (
            f"{self.device.adapter.describe()}: read probe {read:.1f} GB/s, host to device "
            f"{copy:.1f} GB/s{cpu}"
        )
        return read, line

    def device_tier(self) -> DeviceTierStats | None:
        features = self.device.features()
        return dataclasses.replace(
            self.tier.stats, device=f"{self.device.adapter.describe()}; {features}"
        )


@dataclasses.dataclass(frozen=True)
class _Expert:
    gate: QuantWeight
    up: QuantWeight
    down: QuantWeight
