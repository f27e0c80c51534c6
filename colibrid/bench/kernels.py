"""`colibri bench kernels`: effective weight bandwidth of the native matmul kernels
(or, with --backend mlx, cuda or webgpu, of that backend's matmul on the same matrices;
cuda's and webgpu's rows stand beside the device's own read probe, and the run prints its
host-to-device copy rate too: on lavapipe, a Vulkan driver on the CPU, those are CPU
figures).

Decode (S=1) through an expert-shaped matrix is a pure weight stream, so the honest
figure is weight bytes (data + scales) read per second, printed next to the machine's
memory read bandwidth measured in the same run with the same thread count (docs/performance.md).
To measure DRAM and not cache, every case cycles through enough distinct copies of the
matrix to cover --working-set MB, after one warm-up pass that faults the pages in.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from colibrid.backends.base import KernelFamily
from colibrid.formats.affine import affine_sample
from colibrid.formats.weights import AFFINE_FORMATS, QuantWeight, WeightFormat

SHAPES = [(6144, 2048), (2048, 6144)]
FORMATS = {
    "q4g64": (WeightFormat.Q4, 64),
    "q8": (WeightFormat.Q8, 0),
    "fp4": (WeightFormat.FP4, 32),  # MXFP4 as stored (gpt-oss experts)
    "q3": (WeightFormat.Q3, 64),  # low-bit affine codes for cold experts
    "q2": (WeightFormat.Q2, 64),
}


@dataclass
class Row:
    fmt: str
    shape: str
    isa: str
    family: str
    threads: int
    gbs: float
    gflops: float
    membw_gbs: float
    ratio: float
    us_per_call: float


def _weight(fmt: WeightFormat, o: int, i: int, gs: int, rng: np.random.Generator) -> QuantWeight:
    if fmt in AFFINE_FORMATS:
        return affine_sample(fmt, o, i, rng)
    if fmt == WeightFormat.Q8:
        data = rng.integers(-127, 128, (o, i), dtype=np.int8)
        return QuantWeight(fmt, (o, i), data, rng.uniform(0.001, 0.01, o).astype(np.float32))
    data = rng.integers(0, 256, (o, (i + 1) // 2), dtype=np.uint8)
    if fmt == WeightFormat.FP4:  # e8m0 scale bytes
        return QuantWeight(
            fmt, (o, i), data, rng.integers(118, 124, (o, -(-i // gs)), np.uint8), gs
        )
    scales = rng.uniform(0.001, 0.01, (o, -(-i // gs))).astype(np.float32)
    return QuantWeight(fmt, (o, i), data, scales, gs)


def _copies(w: QuantWeight, working_set: int) -> list[QuantWeight]:
    """Distinct copies (own pages, faulted now) totalling at least working_set bytes."""
    n = max(2, -(-working_set // w.nbytes))
    return [
        QuantWeight(
            w.fmt,
            w.shape,
            w.data.copy(),
            None if w.scales is None else w.scales.copy(),
            w.group_size,
        )
        for _ in range(n)
    ]


def _time_case(native, copies, family, x, out, seconds: float) -> float:
    """Seconds per call of the fastest full pass over the copies (after a warm-up pass).

    Best-of-passes rather than the mean: on a shared machine other processes only
    ever make a pass slower, so the fastest pass is the closest to the kernel's speed.
    """
    for w in copies:  # warm-up: pages resident, code paths hot
        native.matmul(w, x, family, out=out)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds or best == float("inf"):
        t0 = time.perf_counter()
        for w in copies:
            native.matmul(w, x, family, out=out)
        best = min(best, (time.perf_counter() - t0) / len(copies))
    return best


def run(
    isas: list[str], threads: int, seconds: float, working_set_mb: int, formats: list[str]
) -> list[Row]:
    from colibrid.backends import calibrate, native

    native.set_threads(threads)
    probe_bytes = max(working_set_mb, 256) << 20

    def probe() -> float:
        return native.membw_probe(probe_bytes, threads=threads, repeats=10)

    membw = probe()
    rng = np.random.default_rng(0)
    rows = []
    for fname in formats:
        fmt, gs = FORMATS[fname]
        for o, i in SHAPES:
            copies = _copies(_weight(fmt, o, i, gs, rng), working_set_mb << 20)
            x = rng.standard_normal(i, dtype=np.float32)
            out = np.empty(o, dtype=np.float32)
            for isa in isas:
                if isa == "auto":  # the dispatched path: what a loaded model runs
                    calibrate.tune({copies[0].layout: o})
                with native.use_isa(isa):
                    for family in (KernelFamily.F32, KernelFamily.I8):
                        dt = _time_case(native, copies, family, x, out, seconds)
                        gbs = copies[0].nbytes / dt / 1e9
                        label = isa
                        if isa == "auto":
                            label = "auto=" + native.choice(fmt, gs, i, family)
                        rows.append(
                            Row(
                                fname,
                                f"{o}x{i}",
                                label,
                                family.value,
                                threads,
                                gbs,
                                2.0 * o * i / dt / 1e9,
                                membw,
                                gbs / membw,
                                dt * 1e6,
                            )
                        )
            del copies
            # Probe between cases too and keep the best figure: like the kernels'
            # best pass, so a busy moment never flatters the ratio.
            membw = max(membw, probe())
    for r in rows:
        r.membw_gbs, r.ratio = membw, r.gbs / membw
    return rows


def _time_ops(ops, copies, x: np.ndarray, seconds: float, family: KernelFamily) -> float:  # noqa: ANN001
    """`_time_case` through a backend's Ops.matmul: what a model's decode pays per matrix
    on that backend, its numpy round trip included. The warm-up pass converts each copy
    once, as a loaded model's first token does."""
    for w in copies:
        ops.matmul(w, x, family)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds or best == float("inf"):
        t0 = time.perf_counter()
        for w in copies:
            ops.matmul(w, x, family)
        best = min(best, (time.perf_counter() - t0) / len(copies))
    return best


def run_backend(
    backend: str,
    threads: int,
    seconds: float,
    working_set_mb: int,
    formats: list[str],
    say: Callable[[str], object] = print,
) -> list[Row]:
    """The decode cases on a non-CPU backend (one row per kernel family it computes,
    format and shape), beside its device's read probe, or the native rows' memory probe."""
    from colibrid.backends import native
    from colibrid.backends.base import DeviceLimits
    from colibrid.engine.backend import make_ops

    ops = make_ops(backend)
    if isinstance(ops, DeviceLimits):  # the device's own memory is the limit of its rows
        membw, line = ops.limits(max(working_set_mb, 256) << 20)
        say(line)
    else:
        membw = native.membw_probe(max(working_set_mb, 256) << 20, threads=threads, repeats=10)
    rng = np.random.default_rng(0)
    rows = []
    families = sorted(ops.families, key=lambda f: f.value)
    for fname in formats:
        fmt, gs = FORMATS[fname]
        for o, i in SHAPES:
            copies = _copies(_weight(fmt, o, i, gs, rng), working_set_mb << 20)
            x = rng.standard_normal((1, i), dtype=np.float32)
            for family in families:
                dt = _time_ops(ops, copies, x, seconds, family)
                gbs = copies[0].nbytes / dt / 1e9
                rows.append(
                    Row(
                        fname,
                        f"{o}x{i}",
                        ops.name,
                        family.value,
                        threads,
                        gbs,
                        2.0 * o * i / dt / 1e9,
                        membw,
                        gbs / membw,
                        dt * 1e6,
                    )
                )
            del copies
    return rows


def _table(rows: list[Row]) -> str:
    head = [
        "format",
        "O x I",
        "isa",
        "family",
        "thr",
        "us/call",
        "GB/s",
        "GFLOP/s",
        "membw GB/s",
        "ratio",
    ]
    body = [
        [
            r.fmt,
            r.shape,
            r.isa,
            r.family,
            str(r.threads),
            f"{r.us_per_call:.1f}",
            f"{r.gbs:.2f}",
            f"{r.gflops:.2f}",
            f"{r.membw_gbs:.2f}",
            f"{r.ratio:.0%}",
        ]
        for r in rows
    ]
    widths = [max(len(c) for c in col) for col in zip(head, *body, strict=True)]
    lines = [
        "  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in [head, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri bench kernels",
        description=(
            "Measure decode (S=1) matmul speed of the native kernels on expert-shaped "
            "matrices (6144x2048 and 2048x6144, int4 group-64 and int8) for every ISA, the "
            "dispatched ('auto') path and each kernel family, as effective weight bandwidth "
            "(data + scale bytes per second) "
            "next to the memory read bandwidth measured in the same run with the same "
            "thread count. A ratio near 100% means the kernel is as fast as memory allows."
        ),
    )
    p.add_argument(
        "--isa",
        action="append",
        help=(
            "ISA to measure (repeatable; default: every available one and 'auto', the "
            "per-layout choice a loaded model dispatches to, measured once per machine)"
        ),
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads (default: COLIBRI_THREADS or the CPU count)",
    )
    p.add_argument(
        "--seconds", type=float, default=1.0, help="seconds per case (best full pass is reported)"
    )
    p.add_argument(
        "--working-set",
        type=int,
        default=512,
        metavar="MB",
        help="bytes of distinct weight copies cycled through (defeats caches)",
    )
    p.add_argument(
        "--format",
        action="append",
        choices=sorted(FORMATS),
        help="weight format (repeatable; default: all)",
    )
    p.add_argument(
        "--backend",
        choices=("cpu", "mlx", "cuda", "webgpu"),
        default="cpu",
        help="cpu: the native kernels per ISA and family (default); mlx, cuda or webgpu: "
        "that backend's matmul (f32 family) on the same matrices, through its Ops (cuda and "
        "webgpu beside the device's own read probe and its host-to-device copy rate)",
    )
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from colibrid.backends import native

    if args.backend != "cpu":
        if args.isa:
            print("error: --isa measures the native kernels; it cannot go with --backend")
            return 2
        threads = args.threads or native.threads()
        formats = args.format or list(FORMATS)
        say = (lambda _line: None) if args.json else print
        rows = run_backend(args.backend, threads, args.seconds, args.working_set, formats, say)
        print(json.dumps([asdict(r) for r in rows], indent=1) if args.json else _table(rows))
        return 0
    isas = args.isa or [*native.available_isas(), "auto"]
    bad = [n for n in isas if n not in native.available_isas() and n != "auto"]
    if bad:
        print(
            f"error: ISA not available here: {', '.join(bad)} "
            f"(available: {', '.join(native.available_isas())})",
            file=sys.stderr,
        )
        return 2
    threads = args.threads or native.threads()
    rows = run(isas, threads, args.seconds, args.working_set, args.format or list(FORMATS))
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(_table(rows))
    return 0
