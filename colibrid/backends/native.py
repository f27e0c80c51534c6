"""Python face of colibri's C kernels: numpy in, numpy out.

Every public function validates its inputs here (dtype, contiguity, shapes against
QuantWeight.shape, scale counts) and raises ValueError, so the C side never sees a bad
pointer.  The C calls release the GIL (cffi API mode does so for every call).

Families (see KernelFamily): F32 expands weights to f32 in registers; I8 quantises
each activation row to int8 (absmax/127, round half to even) and uses exact integer
dot products per scale group, bit-identical across ISAs.  For F32/BF16 weights the I8
family has nothing to quantise against and runs the F32 arithmetic.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from colibrid.backends import native_build
from colibrid.backends.base import GQAWeights, KernelFamily, ResidentExperts, RouteRule
from colibrid.formats.affine import AFFINE_GROUP, affine_groups, affine_row_bytes
from colibrid.formats.weights import AFFINE_FORMATS, NIBBLE_FORMATS, QuantWeight, WeightFormat

ISA_NAMES = ("ref", "avx2", "avx512vnni", "neon")
_FMT_CODE = {
    WeightFormat.F32: 0,
    WeightFormat.BF16: 1,
    WeightFormat.Q8: 2,
    WeightFormat.Q4: 3,
    WeightFormat.FP4: 4,
    WeightFormat.Q2: 5,
    WeightFormat.Q3: 6,
}
_FAMILY_CODE = {KernelFamily.F32: 0, KernelFamily.I8: 1}
_DATA_DTYPE = {
    WeightFormat.F32: np.float32,
    WeightFormat.BF16: np.uint16,
    WeightFormat.Q8: np.int8,
    WeightFormat.Q4: np.uint8,
    WeightFormat.FP4: np.uint8,
    WeightFormat.Q2: np.uint8,
    WeightFormat.Q3: np.uint8,
}
# |sum q_w * q_x| <= 128 * 127 * I must fit in int32 for Q8 (8 * 127 * I for Q4, 12 * 127
# * I for FP4's largest code). Q2/Q3 sum each group of 64 on its own (7 * 127 * 64 at most)
# and carry groups in float, so they have no such limit.
MAX_I = {
    WeightFormat.Q8: (2**31 - 1) // (128 * 127),
    WeightFormat.Q4: (2**31 - 1) // (8 * 127),
    WeightFormat.FP4: (2**31 - 1) // (12 * 127),
}

_mod = native_build.load()
ffi, lib = _mod.ffi, _mod.lib


def _init_from_env() -> None:
    """Honour COLIBRI_ISA / COLIBRI_THREADS strictly: a typo must not pass silently."""
    name = os.environ.get("COLIBRI_ISA")
    if name:
        set_isa(name)
    n = os.environ.get("COLIBRI_THREADS")
    if n:
        set_threads(int(n))
    else:
        set_threads(os.cpu_count() or 1)


def available_isas() -> list[str]:
    """ISAs this CPU (and this build) can run, slowest first."""
    return [n for i, n in enumerate(ISA_NAMES) if lib.colibri_isa_available(i)]


def current_isa() -> str:
    """The process ISA: the forced one, else the best available (layouts with a calibrated
    choice may run on another; see `choice`)."""
    return ISA_NAMES[lib.colibri_get_isa()]


def isa_setting() -> str:
    """What `set_isa` was last given: a forced ISA's name, or "auto"."""
    return current_isa() if lib.colibri_isa_forced() else "auto"


def isa_label() -> str:
    """The ISA as a bench line says it: the forced one, or auto=<the process ISA>."""
    return current_isa() if lib.colibri_isa_forced() else f"auto={current_isa()}"


def set_isa(name: str) -> None:
    """Force one kernel set for every later call (process wide), or "auto": each weight
    layout on its calibrated choice (`colibrid.backends.calibrate`), else the best ISA."""
    if name == "auto":
        lib.colibri_set_isa(-1)
        return
    if name not in ISA_NAMES:
        raise ValueError(f"unknown ISA {name!r}; known: auto, {', '.join(ISA_NAMES)}")
    if lib.colibri_set_isa(ISA_NAMES.index(name)) != 0:
        raise ValueError(f"ISA {name!r} is not available here; available: {available_isas()}")


@contextlib.contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Temporarily switch ISA (tests, benchmarks)."""
    old = isa_setting()
    set_isa(name)
    try:
        yield
    finally:
        set_isa(old)


def _layout_args(fmt: WeightFormat, group_size: int, in_features: int, family: KernelFamily):
    return _FMT_CODE[fmt], int(group_size), int(in_features), _FAMILY_CODE[family]


def set_choice(
    fmt: WeightFormat, group_size: int, in_features: int, family: KernelFamily, isa: str
) -> bool:
    """Run weights of this layout on `isa` while the setting is "auto". The first choice
    for a layout stands for the process (a model loaded earlier keeps its bits): False
    when an earlier, different choice stands or the table is full."""
    if isa not in available_isas():
        raise ValueError(f"ISA {isa!r} is not available here; available: {available_isas()}")
    args = _layout_args(fmt, group_size, in_features, family)
    return lib.colibri_set_choice(*args, ISA_NAMES.index(isa)) == 0


def choice(fmt: WeightFormat, group_size: int, in_features: int, family: KernelFamily) -> str:
    """The ISA a weight of this layout runs on now."""
    return ISA_NAMES[lib.colibri_choice(*_layout_args(fmt, group_size, in_features, family))]


def set_threads(n: int) -> None:
    if int(n) < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    lib.colibri_set_threads(int(n))


def threads() -> int:
    return int(lib.colibri_get_threads())


@dataclass(frozen=True)
class PoolStats:
    """The calling thread's side of the pool's parallel jobs since the last reset: how
    many, seconds inside them, and of those the seconds spent waiting for chunks the
    pool's other threads were still computing."""

    jobs: int
    seconds: float
    wait_s: float

    @property
    def wait_share(self) -> float:
        return self.wait_s / self.seconds if self.seconds else 0.0


def pool_stats(reset: bool = False) -> PoolStats:
    jobs, total, wait = (ffi.new("unsigned long long *") for _ in range(3))
    lib.colibri_pool_stats(jobs, total, wait)
    if reset:
        lib.colibri_pool_stats_reset()
    return PoolStats(int(jobs[0]), total[0] / 1e9, wait[0] / 1e9)


def membw_probe(nbytes: int = 1 << 30, threads: int | None = None, repeats: int = 3) -> float:
    """Best GB/s reading a buffer of nbytes (allocated and pre-faulted once)."""
    if nbytes < 4096:
        raise ValueError("nbytes must be >= 4096")
    gbs = lib.colibri_membw_probe(int(nbytes), int(threads or 0), int(repeats))
    if gbs < 0:
        raise MemoryError(f"cannot allocate {nbytes} bytes for the bandwidth probe")
    return float(gbs)


# ---- validation ------------------------------------------------------------------


_DTYPES = {t: np.dtype(t) for t in (np.float32, np.float16, np.uint16, np.int8, np.uint8, np.int32)}
_SCALE_DTYPE = {
    WeightFormat.FP4: np.uint8,
    WeightFormat.Q2: np.float16,
    WeightFormat.Q3: np.float16,
}
"""Scales that are not float32: FP4's e8m0 bytes, Q2/Q3's float16 (s, m) pairs."""


def _check_array(name: str, a: np.ndarray, dtype: type, shape: tuple[int, ...]) -> None:
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(a).__name__}")
    want = _DTYPES.get(dtype) or np.dtype(dtype)
    if a.dtype is not want and a.dtype != want:
        raise ValueError(f"{name} must be {np.dtype(dtype)}, got {a.dtype}")
    if a.shape != shape:
        raise ValueError(f"{name} has shape {a.shape}, expected {shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def _scale_shape(w: QuantWeight) -> tuple[int, ...] | None:
    o, i = w.shape
    if w.fmt in (WeightFormat.F32, WeightFormat.BF16):
        return None
    if w.fmt in AFFINE_FORMATS:
        return (o, 2 * affine_groups(i))
    if w.fmt == WeightFormat.Q8 or w.group_size == 0:
        return (o,)
    return (o, -(-i // w.group_size))


def _check_weight(w: QuantWeight, family: KernelFamily, name: str = "w") -> None:
    if not isinstance(w, QuantWeight):
        raise ValueError(f"{name} must be a QuantWeight")
    if family not in _FAMILY_CODE:
        raise ValueError(f"family must be a KernelFamily, got {family!r}")
    o, i = w.shape
    if o < 1 or i < 1:
        raise ValueError(f"{name}: shape {w.shape} must be positive")
    if w.fmt in AFFINE_FORMATS:
        cols = affine_row_bytes(w.fmt, i)
    else:
        cols = -(-i // 2) if w.fmt in NIBBLE_FORMATS else i
    _check_array(f"{name}.data", w.data, _DATA_DTYPE[w.fmt], (o, cols))
    if w.fmt == WeightFormat.Q4 and (w.group_size < 0 or w.group_size % 2):
        raise ValueError(f"{name}: Q4 group_size must be 0 or an even number >= 2")
    if w.fmt == WeightFormat.FP4 and (w.group_size < 2 or w.group_size % 2):
        raise ValueError(f"{name}: FP4 group_size must be an even number >= 2")
    if w.fmt in AFFINE_FORMATS and w.group_size != AFFINE_GROUP:
        raise ValueError(f"{name}: {w.fmt.value} group_size must be {AFFINE_GROUP}")
    if w.fmt not in NIBBLE_FORMATS and w.fmt not in AFFINE_FORMATS and w.group_size != 0:
        raise ValueError(f"{name}: group_size is only meaningful for Q4, FP4, Q2 and Q3")
    sshape = _scale_shape(w)
    if sshape is None:
        if w.scales is not None:
            raise ValueError(f"{name}: {w.fmt.value} weights take no scales")
    else:
        if w.scales is None:
            raise ValueError(f"{name}: {w.fmt.value} weights need scales {sshape}")
        if sshape == (o,) and w.scales.shape == (o, 1):
            sshape = (o, 1)
        scale_dtype = _SCALE_DTYPE.get(w.fmt, np.float32)
        _check_array(f"{name}.scales", w.scales, scale_dtype, sshape)
    if family == KernelFamily.I8:
        limit = MAX_I.get(w.fmt, i)
        if i > limit:
            raise ValueError(f"{name}: I={i} too large for exact int32 sums (max {limit})")


def _code(family: KernelFamily) -> int:
    """The C code of a family, by identity: hashing an Enum runs Python code, and this is
    asked several times per kernel call."""
    if family is KernelFamily.F32:
        return 0
    if family is KernelFamily.I8:
        return 1
    raise ValueError(f"family must be a KernelFamily, got {family!r}")


def _native(w: QuantWeight, family: KernelFamily, name: str = "w") -> object:
    """The checked C view of `w` for `family`, built once per weight object and kept on
    it: weights never change after loading, and checking and building the view on every
    call cost ~10 µs of a ~25 µs decode-sized kernel call."""
    views = getattr(w, "_native_views", None)
    code = _code(family)
    if views is not None and views[code] is not None:
        return views[code]
    if not isinstance(w, QuantWeight):
        raise ValueError(f"{name} must be a QuantWeight")
    if views is None:
        views = [None, None]
        object.__setattr__(w, "_native_views", views)  # frozen dataclass: a private cache
    _check_weight(w, family, name)
    views[code] = _weight_struct(w)
    return views[code]


def _expert_views(w: object, family: KernelFamily, k: int, width: int) -> tuple[object, ...]:
    """The three checked C views of an expert (anything with .gate/.up/.down), kept on the
    expert object when it allows (resident experts and shared MLPs live for the model)."""
    cache = getattr(w, "_native_expert_views", None)
    code = _code(family)
    if cache is not None and cache[code] is not None and cache[code][3] == width:
        return cache[code][:3]
    gate, up, down = w.gate, w.up, w.down  # type: ignore[attr-defined]
    views = (
        _native(gate, family, f"weights[{k}].gate"),
        _native(up, family, f"weights[{k}].up"),
        _native(down, family, f"weights[{k}].down"),
    )
    f = gate.shape[0]
    if gate.shape != (f, width) or up.shape != (f, width) or down.shape != (width, f):
        raise ValueError(
            f"expert {k}: gate {gate.shape}, up {up.shape}, down {down.shape} "
            f"do not fit x of width {width}"
        )
    if cache is None:
        cache = [None, None]
        try:
            object.__setattr__(w, "_native_expert_views", cache)
        except (AttributeError, TypeError):  # slotted or immutable: check every call
            return views
    cache[code] = (*views, width)
    return views


def _weight_struct(w: QuantWeight) -> object:
    cw = ffi.new("colibri_weight *")
    cw.fmt = _FMT_CODE[w.fmt]
    cw.O, cw.I = w.shape
    cw.gs = w.group_size
    cw.data = ffi.cast("const void *", w.data.ctypes.data)
    # FP4's scales are bytes, Q2/Q3's float16 pairs: the kernels read them as such
    cw.scales = ffi.NULL if w.scales is None else ffi.cast("const float *", w.scales.ctypes.data)
    return cw


def _rows(x: np.ndarray, width: int, name: str = "x") -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.ndim not in (1, 2):
        raise ValueError(f"{name} must be a 1-D or 2-D numpy array")
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    _check_array(name, x2, np.float32, (x2.shape[0], width))
    if x2.shape[0] < 1:
        raise ValueError(f"{name} must have at least one row")
    return x2


def _out(out: np.ndarray | None, rows: int, width: int, one_d: bool) -> np.ndarray:
    shape = (width,) if one_d else (rows, width)
    if out is None:
        return np.empty(shape, dtype=np.float32)
    _check_array("out", out, np.float32, shape)
    return out


def _raise_rc(rc: int) -> None:
    if rc == -2:
        raise MemoryError("native kernel could not allocate its work buffers")
    if rc != 0:
        raise ValueError(f"native kernel rejected its arguments (code {rc})")


def _fptr(a: np.ndarray) -> object:
    """A float pointer into a checked C-contiguous float32 array. `from_buffer` takes
    ~0.7 µs where `ffi.cast(..., a.ctypes.data)` took ~3.8 µs, on every kernel call."""
    return ffi.from_buffer("float[]", a, require_writable=False)


# ---- kernels ---------------------------------------------------------------------


def matmul(
    w: QuantWeight, x: np.ndarray, family: KernelFamily, out: np.ndarray | None = None
) -> np.ndarray:
    """x: float32 [S, I] C-contiguous (or 1-D [I] -> [O]); returns float32 [S, O] = x @ W^T."""
    view = _native(w, family)
    o, i = w.shape
    x2 = _rows(x, i)
    y = _out(out, x2.shape[0], o, x.ndim == 1)
    rc = lib.colibri_matmul(view, _code(family), _fptr(x2), x2.shape[0], _fptr(y))
    _raise_rc(rc)
    return y


def matmul_blocks(
    w: QuantWeight, x: np.ndarray, family: KernelFamily, out: np.ndarray | None = None
) -> np.ndarray:
    """Block-diagonal product: W's O rows form B = x.shape[-2] equal blocks and block b
    multiplies x[..., b, :]. x: float32 [S, B, I] (or [B, I] -> [O]); returns [S, O].

    Bit-identical to ``matmul`` of each block's rows with its own activation rows."""
    view = _native(w, family)
    o, i = w.shape
    if not isinstance(x, np.ndarray) or x.ndim not in (2, 3):
        raise ValueError("x must be a 2-D [B, I] or 3-D [S, B, I] numpy array")
    x3 = x.reshape(1, *x.shape) if x.ndim == 2 else x
    s, b = x3.shape[0], x3.shape[1]
    _check_array("x", x3, np.float32, (s, b, i))
    if s < 1 or b < 1 or o % b:
        raise ValueError(f"{o} output rows do not split into {b} equal blocks")
    y = _out(out, s, o, x.ndim == 2)
    rc = lib.colibri_matmul_blocks(view, _code(family), _fptr(x3), s, b, _fptr(y))
    _raise_rc(rc)
    return y


def expert_swiglu(
    gate: QuantWeight,
    up: QuantWeight,
    down: QuantWeight,
    x: np.ndarray,
    family: KernelFamily,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Fused expert FFN: y[S, D] = down(silu(gate x) * (up x)), silu(g) = g / (1 + exp(-g)).

    gate/up: [F, D]; down: [D, F].  In the I8 family gate and up share one int8
    quantisation of x, and h = silu(g) * u (f32) is quantised per row for down.
    """
    views = [_native(wt, family, name) for name, wt in (("gate", gate), ("up", up), ("down", down))]
    f, d = gate.shape
    if up.shape != (f, d) or down.shape != (d, f):
        raise ValueError(
            f"expert shapes disagree: gate {gate.shape}, up {up.shape}, down {down.shape}"
        )
    x2 = _rows(x, d)
    y = _out(out, x2.shape[0], d, x.ndim == 1)
    rc = lib.colibri_expert_swiglu(
        *views,
        _code(family),
        _fptr(x2),
        x2.shape[0],
        _fptr(y),
    )
    _raise_rc(rc)
    return y


def matmul_many(
    weights: list[QuantWeight], x: np.ndarray, family: KernelFamily
) -> list[np.ndarray]:
    """x float32 [S, I] times each of several weights of the same I, in one dispatch:
    [x @ W^T for W in weights], bit-identical to ``matmul`` of each."""
    if not weights:
        raise ValueError("matmul_many needs at least one weight")
    views = [_native(w, family, f"weights[{k}]") for k, w in enumerate(weights)]
    width = weights[0].shape[1]
    if any(w.shape[1] != width for w in weights):
        raise ValueError(f"weights disagree on I: {[w.shape for w in weights]}")
    x2 = _rows(x, width)
    ys = [np.empty((x2.shape[0], w.shape[0]), dtype=np.float32) for w in weights]
    rc = lib.colibri_matmul_many(
        ffi.new("colibri_weight *[]", views),
        len(views),
        _code(family),
        _fptr(x2),
        x2.shape[0],
        ffi.new("float *[]", [_fptr(y) for y in ys]),
    )
    _raise_rc(rc)
    return ys


def apply_experts(
    weights: list,
    start: list[int],
    rows: list[int],
    gates: list[float],
    dest: list[int],
    x: np.ndarray,
    out: np.ndarray,
    family: KernelFamily,
) -> None:
    """A MoE layer's experts in two dispatches (gate and up of all, then every down).

    ``weights[e]`` has .gate/.up/.down ([F, D], [F, D], [D, F]); expert e takes the pairs
    p in [start[e], start[e + 1]): out[dest[p]] = gates[p] * swiglu_e(x[rows[p]]), each
    bit-identical to ``expert_swiglu`` on that row. x: float32 [S, D]; out: [R, D]."""
    n = len(weights)
    pairs = len(rows)
    if len(start) != n + 1 or start[0] != 0 or start[-1] != pairs:
        raise ValueError(f"start must run from 0 to {pairs} over {n} experts, got {start}")
    if len(gates) != pairs or len(dest) != pairs:
        raise ValueError("rows, gates and dest must have one entry per pair")
    if any(b < a for a, b in itertools.pairwise(start)):
        raise ValueError(f"start must not decrease, got {start}")
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError("x must be a 2-D [S, D] numpy array")
    d = x.shape[1]
    _check_array("x", x, np.float32, (x.shape[0], d))
    if not isinstance(out, np.ndarray) or out.ndim != 2:
        raise ValueError("out must be a 2-D [R, D] numpy array")
    _check_array("out", out, np.float32, (out.shape[0], d))
    if not out.flags.writeable:
        raise ValueError("out must be writable")
    views: list[object] = []
    for k, w in enumerate(weights):
        views += _expert_views(w, family, k, d)
    if n == 0 or pairs == 0:
        return
    if min(rows) < 0 or max(rows) >= x.shape[0]:
        raise ValueError(f"a row index is outside [0, {x.shape[0]}): {rows}")
    if min(dest) < 0 or max(dest) >= out.shape[0]:
        raise ValueError(f"a destination row is outside [0, {out.shape[0]}): {dest}")
    rc = lib.colibri_experts(
        ffi.new("colibri_weight *[]", views),
        n,
        _code(family),
        _fptr(x),
        x.shape[0],
        d,
        ffi.new("int[]", start),
        ffi.new("int[]", rows),
        ffi.new("float[]", gates),
        ffi.new("int[]", dest),
        out.shape[0],
        ffi.from_buffer("float[]", out),
    )
    _raise_rc(rc)


def rank_sum(parts: np.ndarray) -> np.ndarray:
    """float32 [S, R, D] summed over R in rank order, starting from +0.0: [S, D]."""
    if not isinstance(parts, np.ndarray) or parts.ndim != 3:
        raise ValueError("parts must be a 3-D [S, R, D] numpy array")
    s, r, d = parts.shape
    _check_array("parts", parts, np.float32, (s, r, d))
    if s < 1 or r < 1 or d < 1:
        raise ValueError(f"parts {parts.shape} must be non-empty")
    out = np.empty((s, d), dtype=np.float32)
    _raise_rc(lib.colibri_rank_sum(_fptr(parts), s, r, d, _fptr(out)))
    return out


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """g <- silu(g) * u in place (float32, same shape): the SwiGLU step the native expert
    paths compute, with their bits. Returns g."""
    _check_array("g", g, np.float32, g.shape)
    _check_array("u", u, np.float32, g.shape)
    _raise_rc(lib.colibri_silu_mul(ffi.from_buffer("float[]", g), _fptr(u), g.size))
    return g


def quant_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The I8 family's activations: each row of float32 x [S, I] as the integer kernels
    quantise it. Returns codes int8 [S, I] and scales float32 [S]."""
    if not isinstance(x, np.ndarray) or x.ndim != 2 or x.shape[1] < 1:
        raise ValueError("x must be a 2-D [S, I] numpy array with I >= 1")
    _check_array("x", x, np.float32, x.shape)
    q = np.empty(x.shape, dtype=np.int8)
    xs = np.empty(x.shape[0], dtype=np.float32)
    codes, scales = ffi.from_buffer("int8_t[]", q), ffi.from_buffer("float[]", xs)
    _raise_rc(lib.colibri_quant_rows(_fptr(x), x.shape[0], x.shape[1], codes, scales))
    return q, xs


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis of float32 x [..., D] with weight [D]: weight * (x /
    sqrt(mean(x^2) + eps)); each row alone, so S rows equal S one-row calls."""
    if not isinstance(x, np.ndarray) or x.ndim < 1:
        raise ValueError("x must be a numpy array of rows")
    d = x.shape[-1]
    _check_array("x", x, np.float32, x.shape)
    _check_array("weight", weight, np.float32, (d,))
    rows = x.size // d if d else 0
    if rows < 1 or d < 1:
        raise ValueError(f"x {x.shape} must be non-empty")
    out = np.empty(x.shape, dtype=np.float32)
    _raise_rc(lib.colibri_rms_norm(_fptr(x), rows, d, _fptr(weight), float(eps), _fptr(out)))
    return out


def add_rms_norm(
    h: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """(h + delta, rms_norm(h + delta)) for float32 rows [S, D]: a residual add and the
    norm after it in one call, bit-identical to the two done apart."""
    if not isinstance(h, np.ndarray) or h.ndim != 2:
        raise ValueError("h must be a 2-D [S, D] numpy array")
    s, d = h.shape
    _check_array("h", h, np.float32, (s, d))
    _check_array("delta", delta, np.float32, (s, d))
    _check_array("weight", weight, np.float32, (d,))
    if s < 1 or d < 1:
        raise ValueError(f"h {h.shape} must be non-empty")
    total = np.empty((s, d), dtype=np.float32)
    out = np.empty((s, d), dtype=np.float32)
    rc = lib.colibri_add_rms_norm(
        _fptr(h), _fptr(delta), s, d, _fptr(weight), float(eps), _fptr(total), _fptr(out)
    )
    _raise_rc(rc)
    return total, out


def rope_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """rotate_half RoPE of float32 x [S, H, d] by cos/sin [S, half] (the first 2 * half dims
    rotate, the rest are copied); bit-identical to the numpy formula."""
    if not isinstance(x, np.ndarray) or x.ndim != 3:
        raise ValueError("x must be a 3-D [S, H, d] numpy array")
    s, h, d = x.shape
    _check_array("x", x, np.float32, (s, h, d))
    if not isinstance(cos, np.ndarray) or cos.ndim != 2:
        raise ValueError("cos must be a 2-D [S, half] numpy array")
    half = cos.shape[1]
    _check_array("cos", cos, np.float32, (s, half))
    _check_array("sin", sin, np.float32, (s, half))
    if s < 1 or h < 1 or half < 1 or 2 * half > d:
        raise ValueError(f"rope shapes disagree: x {x.shape}, cos {cos.shape}")
    out = np.empty_like(x)
    rc = lib.colibri_rope_half(_fptr(x), s, h, d, _fptr(cos), _fptr(sin), half, _fptr(out))
    _raise_rc(rc)
    return out


def route(
    h: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, rule: RouteRule, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """The router (sigmoid or softmax scores, as ``rule`` says) for float32 h [S, D] and
    weight [E, D]: (ids int64 [S, n], the n best experts by selection score, best first,
    and gates float32 [S, top_k] of the first top_k). See colibri_route in colibri.h for
    the exact rule."""
    top_k, n_group, topk_group = rule.top_k, rule.n_group, rule.topk_group
    if not isinstance(h, np.ndarray) or h.ndim != 2:
        raise ValueError("h must be a 2-D [S, D] numpy array")
    s, d = h.shape
    _check_array("h", h, np.float32, (s, d))
    if not isinstance(weight, np.ndarray) or weight.ndim != 2:
        raise ValueError("weight must be a 2-D [E, D] numpy array")
    e = weight.shape[0]
    _check_array("weight", weight, np.float32, (e, d))
    if bias is not None:
        _check_array("bias", bias, np.float32, (e,))
    if s < 1 or not 1 <= top_k <= n <= e or n_group < 1 or e % n_group:
        raise ValueError(f"router arguments disagree: h {h.shape}, weight {weight.shape}, n {n}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group {topk_group} must be in [1, {n_group}]")
    ids = np.empty((s, n), dtype=np.int32)
    gates = np.empty((s, top_k), dtype=np.float32)
    rc = lib.colibri_route(
        _fptr(h),
        s,
        d,
        _fptr(weight),
        ffi.NULL if bias is None else _fptr(bias),
        e,
        n_group,
        topk_group,
        n,
        top_k,
        int(rule.softmax),
        int(rule.norm),
        float(rule.scaling),
        ffi.from_buffer("int32_t[]", ids),
        _fptr(gates),
    )
    _raise_rc(rc)
    return ids.astype(np.int64), gates


class _MoEStatic(NamedTuple):
    """A resident layer's checked C side for one family, width, shared expert and router:
    every expert's three views (3E pointers), the shared expert's, the router's pointers."""

    key: tuple[int, int, int, int, int]  # family code, width, ids of shared, weight, bias
    held: tuple[object, ...]  # the objects whose ids make the key, kept alive with it
    views: object
    shared: object
    weight: object
    bias: object


def _moe_static(
    layer: ResidentExperts,
    shared: object | None,
    weight: np.ndarray,
    bias: np.ndarray | None,
    family: KernelFamily,
    width: int,
) -> _MoEStatic:
    """Built once per layer (and kept on it, which lives as long as its weights): building
    3E views and checking the router was most of a decode step's wrapper time."""
    code = _code(family)
    key = (code, width, id(shared), id(weight), id(bias))
    static = getattr(layer, "_native_moe", None)
    if static is not None and static.key == key:
        return static
    e = len(layer)
    _check_array("weight", weight, np.float32, (e, width))
    if bias is not None:
        _check_array("bias", bias, np.float32, (e,))
    views: list[object] = []
    for k, w in enumerate(layer.experts):
        views += _expert_views(w, family, k, width)
    static = _MoEStatic(
        key,
        (shared, weight, bias),
        ffi.new("colibri_weight *[]", views),
        ffi.NULL
        if shared is None
        else ffi.new("colibri_weight *[]", list(_expert_views(shared, family, e, width))),
        _fptr(weight),
        ffi.NULL if bias is None else _fptr(bias),
    )
    layer._native_moe = static  # type: ignore[attr-defined]
    return static


def moe(
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None,
    rule: RouteRule,
    layer: ResidentExperts,
    shared: object | None,
    family: KernelFamily,
) -> tuple[np.ndarray, np.ndarray]:
    """A resident MoE layer in one call (colibri_moe): (ids int32 [S, top_k], out [S, D]).

    x float32 [S, D]; weight float32 [E, D] and bias [E] (or None) route as `route` with
    n = top_k; ``layer.experts[e]`` has .gate/.up/.down; ``shared`` likewise or None."""
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError("x must be a 2-D [S, D] numpy array")
    s, d = x.shape
    _check_array("x", x, np.float32, (s, d))
    if s < 1 or not 1 <= rule.top_k <= len(layer):
        raise ValueError(
            f"router arguments disagree: x {x.shape}, {len(layer)} experts, top_k {rule.top_k}"
        )
    static = _moe_static(layer, shared, weight, bias, family, d)
    ids = np.empty((s, rule.top_k), dtype=np.int32)
    out = np.empty((s, d), dtype=np.float32)
    rc = lib.colibri_moe(
        static.views,
        len(layer),
        static.shared,
        _code(family),
        _fptr(x),
        s,
        d,
        static.weight,
        static.bias,
        rule.n_group,
        rule.topk_group,
        rule.top_k,
        int(rule.softmax),
        int(rule.norm),
        float(rule.scaling),
        ffi.from_buffer("int32_t[]", ids),
        _fptr(out),
    )
    _raise_rc(rc)
    return ids, out


class _GQAStatic(NamedTuple):
    """What `gqa_attention` checked about a block, for one family and head shape."""

    key: tuple[int, int, int]  # (family code, G, d)
    views: list
    bias_ptrs: list
    norm_ptrs: list
    heads: int
    window: int  # 0: every causal key
    sinks: object  # float pointer to [heads], or NULL


def gqa_attention(
    block: GQAWeights,
    rope: tuple[np.ndarray, np.ndarray],
    x: np.ndarray,
    caches: tuple[np.ndarray, np.ndarray],
    start: int,
    scale: float,
    family: KernelFamily,
) -> np.ndarray:
    """A GQA attention block in one call (see colibri_gqa_attention): x float32 [S, D],
    caches (keys, values) float32 [capacity, G, d] whose rows [start, start + S) are
    written; returns [S, O] = attention(q, keys, values) Wo^T. What is checked about
    ``block`` (its weights, biases and norms against the head shape) is kept on it; the
    activations, caches and rows are checked every call."""
    keys, values = caches
    if not isinstance(keys, np.ndarray) or keys.ndim != 3:
        raise ValueError("the key cache must be a 3-D [capacity, G, d] numpy array")
    cap, g, d = keys.shape
    static = block.__dict__.get("_native_static")
    if static is None or static.key != (_code(family), g, d):
        static = _gqa_static(block, family, g, d)
        object.__setattr__(block, "_native_static", static)  # frozen: a private cache
    _check_array("keys", keys, np.float32, (cap, g, d))
    _check_array("values", values, np.float32, (cap, g, d))
    if not (keys.flags.writeable and values.flags.writeable):
        raise ValueError("the caches must be writable")
    x2 = _rows(x, block.q.shape[1])
    s = x2.shape[0]
    if not 0 <= start <= cap - s:
        raise ValueError(f"rows [{start}, {start + s}) do not fit a cache of {cap} positions")
    cos, sin = rope
    if not isinstance(cos, np.ndarray) or cos.ndim != 2:
        raise ValueError("cos must be a 2-D [S, half] numpy array")
    half = cos.shape[1]
    _check_array("cos", cos, np.float32, (s, half))
    _check_array("sin", sin, np.float32, (s, half))
    if not 1 <= half <= d // 2:
        raise ValueError(f"rope half {half} does not fit head dim {d}")
    out = np.empty((s, block.o.shape[0]), dtype=np.float32)
    rc = lib.colibri_gqa_attention(
        *static.views,
        _code(family),
        *static.bias_ptrs,
        *static.norm_ptrs,
        int(block.qk_norm_whole),
        float(block.eps),
        _fptr(cos),
        _fptr(sin),
        half,
        _fptr(x2),
        s,
        static.heads,
        g,
        d,
        ffi.from_buffer("float[]", keys),
        ffi.from_buffer("float[]", values),
        int(start),
        static.window,
        static.sinks,
        float(scale),
        _fptr(out),
    )
    _raise_rc(rc)
    return out


def _gqa_static(block: GQAWeights, family: KernelFamily, g: int, d: int) -> _GQAStatic:
    """The checked C side of a block's weights for G KV heads of dimension d."""
    weights = (block.q, block.k, block.v, block.o)
    views = [_native(w, family, n) for w, n in zip(weights, ("q", "k", "v", "o"), strict=True)]
    wq, wk, wv, wo = weights
    hidden = wq.shape[1]
    heads = wq.shape[0] // d
    if (
        g < 1
        or heads < 1
        or heads % g
        or wq.shape != (heads * d, hidden)
        or wk.shape != (g * d, hidden)
        or wv.shape != (g * d, hidden)
        or wo.shape[1] != heads * d
    ):
        raise ValueError(
            f"attention shapes disagree: q {wq.shape}, k {wk.shape}, v {wv.shape}, "
            f"o {wo.shape}, caches [*, {g}, {d}]"
        )
    bias_ptrs = [ffi.NULL] * 3
    if block.biases is not None:
        sizes = (heads * d, g * d, g * d)
        for k, (b, n) in enumerate(zip(block.biases, sizes, strict=True)):
            _check_array(f"bias[{k}]", b, np.float32, (n,))
            bias_ptrs[k] = _fptr(b)
    norm_ptrs = [ffi.NULL, ffi.NULL]
    if block.qk_norm is not None:
        sizes = (heads * d, g * d) if block.qk_norm_whole else (d, d)
        for k, (w, n) in enumerate(zip(block.qk_norm, sizes, strict=True)):
            _check_array(f"qk_norm[{k}]", w, np.float32, (n,))
            norm_ptrs[k] = _fptr(w)
    window = _window(block.window)
    sinks = ffi.NULL
    if block.sinks is not None:
        _check_array("sinks", block.sinks, np.float32, (heads,))
        sinks = _fptr(block.sinks)
    return _GQAStatic((_code(family), g, d), views, bias_ptrs, norm_ptrs, heads, window, sinks)


def _window(window: int | None) -> int:
    """A sliding window as the kernels take it: 0 for none, else a positive key count."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window {window!r} must be None or a positive int")
    return window


def attend_gqa(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    scale: float,
    start: int,
    window: int | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Causal grouped-query attention: q float32 [S, H, d] at positions start..start+S-1,
    keys and values float32 [T, G, d] (C-contiguous, T >= start + S); returns [S, H * d].

    Query head h reads KV head h // (H / G); with ``window`` the row at position p sees
    keys t > p - window only; ``sinks`` float32 [H] adds a logit per head to the softmax
    that attends to nothing (gpt-oss). Softmax in float32 with the row's maximum
    subtracted; every (row, head) is computed alone, so S rows equal S one-row calls."""
    if not isinstance(q, np.ndarray) or q.ndim != 3:
        raise ValueError("q must be a 3-D [S, H, d] numpy array")
    s, h, d = q.shape
    if not isinstance(keys, np.ndarray) or keys.ndim != 3:
        raise ValueError("keys must be a 3-D [T, G, d] numpy array")
    t, g = keys.shape[0], keys.shape[1]
    _check_array("q", q, np.float32, (s, h, d))
    _check_array("keys", keys, np.float32, (t, g, d))
    _check_array("values", values, np.float32, (t, g, d))
    if s < 1 or g < 1 or h % g or not 0 <= start <= t - s:
        raise ValueError(
            f"attention shapes disagree: q {q.shape}, keys {keys.shape}, start {start}"
        )
    span = _window(window)
    sink_ptr = ffi.NULL
    if sinks is not None:
        _check_array("sinks", sinks, np.float32, (h,))
        sink_ptr = _fptr(sinks)
    out = np.empty((s, h * d), dtype=np.float32)
    rc = lib.colibri_attend_gqa(
        _fptr(q),
        s,
        h,
        d,
        _fptr(keys),
        _fptr(values),
        t,
        g,
        float(scale),
        start,
        span,
        sink_ptr,
        _fptr(out),
    )
    _raise_rc(rc)
    return out


_init_from_env()
