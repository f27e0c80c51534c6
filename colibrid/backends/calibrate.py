"""Which ISA's kernel runs each weight layout: measured once per machine and native build.

Why: ranking ISAs is not the same as measuring them. On this project's 2-core Zen 4 EPYC
`colibri bench kernels` put AVX2 ahead of AVX-512 for int8 rows (29 vs 23 GB/s at
6144x2048, F32 family) and for int4-g64 in the I8 family, while AVX-512 won int4-g64 in
the F32 family. So before a model's first token the CPU backend times every layout the
model holds (format, Q4 group, I; `WeightLayout`) on every available ISA, per kernel
family, and registers the fastest with the kernels (`native.set_choice`).

Bits: integer (I8 family) kernels are bit-exact across ISAs, so there the choice is free.
F32-family results depend on the ISA's reduction order, so the choice must be the same in
every process on this machine, or the daemon and a reference run would differ: results
are cached in `calibration.json` beside the native build and measured under its lock, the
first measurement is kept, and the key never includes S, O or the thread count (S rows
must run what S single rows run; equal layouts share one prepared activation).
`COLIBRI_ISA` or `native.set_isa(name)` forces one ISA and skips all of this.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from colibrid.backends.base import KernelFamily
from colibrid.formats.affine import affine_groups, affine_row_bytes, affine_sample
from colibrid.formats.weights import AFFINE_FORMATS, QuantWeight, WeightFormat, WeightLayout

# Smaller matrices are bound by call overhead, not by the kernel: they keep the default.
MIN_MATRIX_BYTES = 128 << 10
# Distinct copies cycled per timed pass, so the figure is DRAM speed, not cache speed.
WORKING_SET_BYTES = 48 << 20
ROUNDS = 5
# The highest-ranked ISA keeps a layout unless another is faster by more than this:
# measurement noise must not move a layout off the default.
MARGIN = 0.03
FILE_NAME = "calibration.json"


def cache_file() -> Path:
    from colibrid.backends import native_build

    return native_build.build().parent / FILE_NAME


def _key(layout: WeightLayout, family: KernelFamily) -> str:
    return f"{layout.fmt.value}:{layout.group}:{layout.in_features}:{family.value}"


def _families(fmt: WeightFormat) -> tuple[KernelFamily, ...]:
    """Families whose arithmetic differs for this format (float weights have one path)."""
    if fmt in (WeightFormat.Q8, WeightFormat.Q4, WeightFormat.FP4) or fmt in AFFINE_FORMATS:
        return (KernelFamily.F32, KernelFamily.I8)
    return (KernelFamily.F32,)


def _matrix_bytes(layout: WeightLayout, rows: int) -> int:
    i = layout.in_features
    if layout.fmt in AFFINE_FORMATS:  # blocks plus a float16 pair per group
        return (affine_row_bytes(layout.fmt, i) + 4 * affine_groups(i)) * rows
    per_row = {
        WeightFormat.F32: 4 * i,
        WeightFormat.BF16: 2 * i,
        WeightFormat.Q8: i + 4,
        WeightFormat.Q4: (i + 1) // 2 + 4 * -(-i // max(layout.group, 1)),
        WeightFormat.FP4: (i + 1) // 2 + -(-i // max(layout.group, 1)),
    }[layout.fmt]
    return per_row * rows


def worth_tuning(layouts: Mapping[WeightLayout, int]) -> dict[WeightLayout, int]:
    """The layouts (with their largest row count) big enough for the kernel to matter."""
    return {lay: o for lay, o in layouts.items() if _matrix_bytes(lay, o) >= MIN_MATRIX_BYTES}


def sample_weight(layout: WeightLayout, rows: int, rng: np.random.Generator) -> QuantWeight:
    """A random matrix of ``layout`` with ``rows`` rows, valid for its format: what the
    kernels are timed on (here and by the live roofline, serve.kernel_ceiling)."""
    i = layout.in_features
    if layout.fmt in AFFINE_FORMATS:
        return affine_sample(layout.fmt, rows, i, rng)
    if layout.fmt == WeightFormat.FP4:  # codes and e8m0 scale bytes (factors 2^-9 .. 2^-6)
        data = rng.integers(0, 256, (rows, (i + 1) // 2), dtype=np.uint8)
        scales = rng.integers(119, 123, (rows, -(-i // layout.group))).astype(np.uint8)
        return QuantWeight(layout.fmt, (rows, i), data, scales, layout.group)
    if layout.fmt == WeightFormat.Q4:
        data = rng.integers(0, 256, (rows, (i + 1) // 2), dtype=np.uint8)
        groups = -(-i // layout.group)
        scales = rng.uniform(1e-3, 1e-2, (rows, groups)).astype(np.float32)
        gs = layout.group if layout.group < i else 0
        return QuantWeight(layout.fmt, (rows, i), data, scales, gs)
    if layout.fmt == WeightFormat.Q8:
        data = rng.integers(-127, 128, (rows, i), dtype=np.int8)
        return QuantWeight(
            layout.fmt, (rows, i), data, rng.uniform(1e-3, 1e-2, rows).astype(np.float32)
        )
    values = rng.standard_normal((rows, i), dtype=np.float32)
    if layout.fmt == WeightFormat.BF16:
        return QuantWeight(layout.fmt, (rows, i), (values.view(np.uint32) >> 16).astype(np.uint16))
    return QuantWeight(layout.fmt, (rows, i), values)


def _copies(layout: WeightLayout, rows: int) -> list[QuantWeight]:
    rng = np.random.default_rng(0)
    one = _matrix_bytes(layout, rows)
    return [sample_weight(layout, rows, rng) for _ in range(max(2, WORKING_SET_BYTES // one))]


def measure(layout: WeightLayout, rows: int) -> dict[str, dict[str, float]]:
    """Microseconds per S = 1 call of each available ISA, per family: the best of
    ROUNDS interleaved passes over distinct copies (others only ever slow a pass)."""
    from colibrid.backends import native

    copies = _copies(layout, rows)
    x = np.random.default_rng(1).standard_normal(layout.in_features, dtype=np.float32)
    out = np.empty(rows, dtype=np.float32)
    isas = [n for n in native.available_isas() if n != "ref"] or ["ref"]
    result: dict[str, dict[str, float]] = {}
    for family in _families(layout.fmt):
        best = dict.fromkeys(isas, float("inf"))
        for isa in isas:  # warm-up: pages in, code hot
            with native.use_isa(isa):
                for w in copies:
                    native.matmul(w, x, family, out=out)
        for _ in range(ROUNDS):
            for isa in isas:
                with native.use_isa(isa):
                    t0 = time.perf_counter()
                    for w in copies:
                        native.matmul(w, x, family, out=out)
                    per_call = (time.perf_counter() - t0) / len(copies) * 1e6
                best[isa] = min(best[isa], per_call)
        result[family.value] = best
    return result


def pick(timings: Mapping[str, float], default: str) -> str:
    """The fastest ISA, unless the default is within MARGIN of it."""
    fastest = min(timings, key=timings.__getitem__)
    if default in timings and timings[default] <= timings[fastest] * (1.0 + MARGIN):
        return default
    return fastest


def _read(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict[str, dict]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def tune(layouts: Mapping[WeightLayout, int], *, path: Path | None = None) -> dict[str, str]:
    """Register the measured choice for every layout worth it; measure the ones this
    machine has not seen yet. Returns {layout key: ISA} of what was registered. Does
    nothing while an ISA is forced."""
    from colibrid.backends import native, native_build

    if native.isa_setting() != "auto":
        return {}
    wanted = worth_tuning(layouts)
    if not wanted:
        return {}
    path = path or cache_file()
    default = native.current_isa()
    with native_build.locked(path.with_name(path.name + ".lock")):
        known = _read(path)
        missing = {
            lay: rows
            for lay, rows in wanted.items()
            if any(_key(lay, f) not in known for f in _families(lay.fmt))
        }
        if missing:
            for lay, rows in missing.items():
                for family, timings in measure(lay, rows).items():
                    key = _key(lay, KernelFamily(family))
                    known.setdefault(key, {"isa": pick(timings, default), "us": timings})
            _write(path, known)
    chosen: dict[str, str] = {}
    available = set(native.available_isas())
    for lay in wanted:
        for family in _families(lay.fmt):
            entry = known.get(_key(lay, family), {})
            isa = entry.get("isa")
            if isa not in available:
                continue
            families = (family,) if len(_families(lay.fmt)) > 1 else tuple(KernelFamily)
            for fam in families:
                if native.set_choice(lay.fmt, lay.group, lay.in_features, fam, isa):
                    chosen[_key(lay, fam)] = isa
    return chosen
