"""A model directory: config.json plus safetensors weight files, read as typed weights.

Why this layer exists: model code asks for ``weight(name, (O, I))`` and gets a
:class:`QuantWeight` in whatever format the files hold (an HF checkpoint in F32, BF16,
F16 or block-scaled FP8, or an upstream colibri container with int8/int4 weights),
with the logical shape it derived from config.json *checked* against the bytes. Every
problem with untrusted files surfaces as one CheckpointError / ConfigError line naming
the file or tensor.

Weight files are found from ``model.safetensors.index.json`` when present (every file it
names must be a plain relative path inside the directory: no traversal), else from all
``*.safetensors`` in the directory (``model.safetensors``, ``model-0000k-of-0000n``, and
upstream colibri's ``out-NNNNN`` / ``out-mtp-NNNNN`` / ``out-idx-NNNNN`` shards). A
tensor defined in two files is an error. Files are memory-mapped lazily; nothing reads a
whole file.

Colibri containers carry no format ordinal: a quantised weight is a U8 tensor ``name``
plus an F32 tensor ``name.qs`` and its format follows from byte arithmetic against
[O, I] (DESIGN §5, upstream FORMATS.md), see :func:`resolve_container_format`.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import TracebackType

import numpy as np

from colibrid.errors import CheckpointError, ColibriError, ConfigError
from colibrid.formats import quant
from colibrid.formats.weights import QuantWeight, WeightFormat
from colibrid.store.safetensors_file import (
    SafetensorsFile,
    TensorInfo,
    describe,
    load_json_object,
)

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
CONVERT_PROGRESS_NAME = ".colibri-convert.json"
MAX_JSON_FILE_BYTES = 64 * 1024 * 1024
MAX_STAMPS = 4096
"""Upstream caps the container-wide ``colibri.fmt`` stamp map at 4096 entries."""

STAMP_KEY = "colibri.fmt"
GROUP_SIZE_KEY = "colibri.group_size"
GROUP_SIZES = tuple(1 << k for k in range(4, 13))  # 16 .. 4096

INT8_ROW = "int8-row"
INT4_ROW = "int4-row"
INT4_GROUPED = "int4-grouped"
FP8_B128 = "fp8-e4m3-b128"
SUPPORTED_FORMATS = (INT8_ROW, INT4_ROW, INT4_GROUPED, FP8_B128)
KNOWN_UNSUPPORTED = ("f32", "int2-row", "int3-g64", "e8-iq3-lattice", "mxfp4", "int4-rans256-g0")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def read_small_file(path: Path, what: str, error: type[ColibriError]) -> bytes:
    """Read a small regular file (JSON) with a size cap, never blocking on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except (OSError, ValueError) as exc:
        raise error(f"{path}: cannot open {what} ({getattr(exc, 'strerror', exc)})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: {what} is not a regular file")
        if st.st_size > MAX_JSON_FILE_BYTES:
            raise error(f"{path}: {what} is {st.st_size} bytes (cap {MAX_JSON_FILE_BYTES})")
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(MAX_JSON_FILE_BYTES + 1)[:MAX_JSON_FILE_BYTES]
    finally:
        os.close(fd)


# ---- format inference for colibri containers --------------------------------------


@dataclass(frozen=True)
class ContainerFormat:
    """What a ``name`` + ``name.qs`` pair holds, deduced from byte arithmetic."""

    name: str  # one of SUPPORTED_FORMATS
    group_size: int = 0


def _group_size_for(in_features: int, groups: int, hint: int | None) -> int | None:
    """The group size gs with ceil(I/gs) == groups.

    A ``colibri.group_size`` hint wins when it fits. Otherwise powers of two 16..4096 are
    tried; for groups >= 2 at most one power of two can fit (ceil(x) == ceil(x/2) only
    for x <= 1), so 64-first-then-smallest only matters for hand-made inputs.
    """
    if hint is not None and _ceil_div(in_features, hint) == groups:
        return hint
    fits = [gs for gs in GROUP_SIZES if _ceil_div(in_features, gs) == groups]
    if 64 in fits:
        return 64
    return fits[0] if fits else None


def container_candidates(
    shape: tuple[int, int], nbytes: int, n_scales: int, scale_dtype: str, hint: int | None
) -> list[ContainerFormat]:
    """Every supported format whose sizes match, in upstream's preference order.

    Known collisions and how they resolve without a stamp: I == 1 makes int8-row and
    int4-row byte-identical (int8-row wins); small shapes make int8-row and fp8-e4m3-b128
    identical (int8-row wins, as upstream's "INVERSION" rule). A grouped int4 tensor whose
    single group spans the row is reported as int4-row: the arithmetic is the same.
    """
    out_f, in_f = shape
    q4_bytes = out_f * quant.q4_row_bytes(in_f)
    found: list[ContainerFormat] = []
    if scale_dtype == "F32":
        if nbytes == out_f * in_f and n_scales == out_f:
            found.append(ContainerFormat(INT8_ROW))
        if nbytes == q4_bytes and n_scales == out_f:
            found.append(ContainerFormat(INT4_ROW))
        if nbytes == q4_bytes and n_scales % out_f == 0 and n_scales // out_f > 1:
            gs = _group_size_for(in_f, n_scales // out_f, hint)
            if gs is not None:
                found.append(ContainerFormat(INT4_GROUPED, gs))
    fp8_scales = _ceil_div(out_f, quant.FP8_BLOCK) * _ceil_div(in_f, quant.FP8_BLOCK)
    if scale_dtype in ("F32", "F8_E8M0") and nbytes == out_f * in_f and n_scales == fp8_scales:
        found.append(ContainerFormat(FP8_B128))
    return found


def resolve_container_format(
    tensor: str,
    shape: tuple[int, int],
    nbytes: int,
    n_scales: int,
    scale_dtype: str,
    *,
    stamp: str | None = None,
    hint: int | None = None,
) -> ContainerFormat:
    """Pick the format of a container weight, trust-verify-refuse on a stamp.

    A ``colibri.fmt`` stamp must name a format the sizes allow (it then also breaks
    ties); a stamp naming something else, or a format we cannot decode, is refused.
    """
    found = container_candidates(shape, nbytes, n_scales, scale_dtype, hint)
    if stamp is not None:
        if stamp not in SUPPORTED_FORMATS:
            kind = "unsupported" if stamp in KNOWN_UNSUPPORTED else "unknown"
            raise CheckpointError(
                f"tensor {describe(tensor)}: stamped format {describe(stamp, 40)} is {kind}"
            )
        for cand in found:
            if cand.name == stamp or (stamp == INT4_GROUPED and cand.name == INT4_ROW):
                return cand
        inferred = found[0].name if found else "nothing"
        raise CheckpointError(
            f"tensor {describe(tensor)}: stamped {stamp} but its sizes say {inferred}"
        )
    if found:
        return found[0]
    out_f, in_f = shape
    q4 = out_f * quant.q4_row_bytes(in_f)
    raise CheckpointError(
        f"tensor {describe(tensor)}: {nbytes} bytes + {n_scales} {scale_dtype} scales match no "
        f"format for [{out_f}, {in_f}] (int8-row {out_f * in_f}+{out_f}, int4-row {q4}+{out_f}, "
        f"int4-grouped {q4}+{out_f}*ceil({in_f}/gs))"
    )


def _collect_stamps(files: list[SafetensorsFile]) -> dict[str, str]:
    """Container-wide ``colibri.fmt`` map; agreeing duplicates fine, conflicts refused."""
    stamps: dict[str, str] = {}
    for f in files:
        raw = f.metadata.get(STAMP_KEY)
        if raw is None:
            continue
        what = f"{f.path}: __metadata__[{STAMP_KEY!r}]"
        mapping = load_json_object(raw.encode("utf-8"), what)
        for tensor, fmt in mapping.items():
            if not isinstance(fmt, str):
                raise CheckpointError(f"{what}: format of {describe(tensor)} is not a string")
            if stamps.setdefault(tensor, fmt) != fmt:
                raise CheckpointError(
                    f"{what}: tensor {describe(tensor)} stamped both "
                    f"{describe(stamps[tensor], 40)} and {describe(fmt, 40)}"
                )
            if len(stamps) > MAX_STAMPS:
                raise CheckpointError(f"{what}: more than {MAX_STAMPS} stamped tensors")
    return stamps


# ---- finding weight files ---------------------------------------------------------


def _safe_member(model_dir: Path, fname: object, index: Path) -> Path:
    """A weight-map file name as a path inside ``model_dir`` (lexically: no absolute
    paths, no '..'); symlinks inside the directory are the owner's choice (HF caches)."""
    if not isinstance(fname, str) or not fname or "\x00" in fname:
        raise CheckpointError(f"{index}: bad file name {describe(fname)} in weight_map")
    rel = PurePosixPath(fname)
    if rel.is_absolute() or ".." in rel.parts or fname.startswith("~"):
        raise CheckpointError(f"{index}: file {describe(fname)} points outside the model directory")
    path = model_dir.joinpath(*rel.parts)
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        regular = False
    if not regular:
        raise CheckpointError(f"{index}: file {describe(fname)} in weight_map does not exist")
    return path


def _index_files(model_dir: Path, index: Path) -> tuple[list[Path], dict[str, Path]]:
    doc = load_json_object(read_small_file(index, "index", CheckpointError), str(index))
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: 'weight_map' is missing or not a non-empty object")
    claims: dict[str, Path] = {}
    files: dict[Path, None] = {}
    for tensor, fname in weight_map.items():
        path = _safe_member(model_dir, fname, index)
        claims[tensor] = path
        files.setdefault(path)
    return list(files), claims


def _glob_files(model_dir: Path) -> list[Path]:
    return sorted(
        p for p in model_dir.glob("*.safetensors") if p.is_file() and not p.name.startswith(".")
    )


# ---- the checkpoint ---------------------------------------------------------------


class Checkpoint:
    """A model directory opened for reading: config, tensor index, typed weights."""

    def __init__(self, model_dir: Path, config: dict[str, object], files: list[SafetensorsFile]):
        self.dir = model_dir
        self._config = config
        self.files = files
        self._where: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.tensors:
                other = self._where.setdefault(name, f)
                if other is not f:
                    raise CheckpointError(
                        f"{model_dir}: tensor {describe(name)} is defined in both "
                        f"{other.path.name} and {f.path.name}"
                    )
        self._stamps = _collect_stamps(files)

    @classmethod
    def open(cls, model_dir: str | os.PathLike[str]) -> Checkpoint:
        root = Path(model_dir)
        if not root.exists():
            raise CheckpointError(f"{root}: model directory not found")
        if not root.is_dir():
            raise CheckpointError(f"{root}: not a directory")
        _refuse_incomplete_conversion(root)
        config = load_json_object(
            read_small_file(root / CONFIG_NAME, CONFIG_NAME, ConfigError),
            str(root / CONFIG_NAME),
            ConfigError,
        )
        index = root / INDEX_NAME
        claims: dict[str, Path] = {}
        if index.exists():
            paths, claims = _index_files(root, index)
        else:
            paths = _glob_files(root)
        if not paths:
            raise CheckpointError(f"{root}: no *.safetensors weight files")
        files: list[SafetensorsFile] = []
        try:
            for path in paths:
                files.append(SafetensorsFile.open(path))
            ckpt = cls(root, config, files)
            ckpt._check_claims(index, claims)
        except BaseException:
            for f in files:
                f.close()
            raise
        return ckpt

    def _check_claims(self, index: Path, claims: dict[str, Path]) -> None:
        for tensor, path in claims.items():
            f = self._where.get(tensor)
            if f is None or f.path != path:
                raise CheckpointError(
                    f"{index}: tensor {describe(tensor)} is not in {path.name} as claimed"
                )

    # ---- lookup -------------------------------------------------------------------

    @property
    def config(self) -> dict[str, object]:
        """config.json as parsed (validated to be a JSON object; values unchecked)."""
        return self._config

    def names(self) -> list[str]:
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def _file(self, name: str) -> SafetensorsFile:
        try:
            return self._where[name]
        except KeyError:
            raise CheckpointError(f"{self.dir}: tensor {describe(name)} not found") from None

    def info(self, name: str) -> TensorInfo:
        return self._file(name).tensors[name]

    def file_of(self, name: str) -> Path:
        return self._file(name).path

    def array(self, name: str) -> np.ndarray:
        """The raw read-only view of a tensor (see SafetensorsFile.array)."""
        return self._file(name).array(name)

    def _fail(self, name: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.file_of(name)}: tensor {describe(name)}: {problem}")

    # ---- typed access -------------------------------------------------------------

    def weight(self, name: str, shape: tuple[int, int]) -> QuantWeight:
        """The matrix ``name`` with logical shape [O, I] (from config), format as stored.

        F32 and BF16 are zero-copy views; F16 and FP8 (HF ``weight_scale_inv``
        convention, 128x128 blocks) come back dequantised to F32; colibri containers
        (``name`` U8 + ``name.qs`` F32) come back as Q8/Q4 views.
        """
        out_f, in_f = _matrix_shape(name, shape)
        info = self.info(name)
        if info.dtype == "U8":
            if not self.has(name + ".qs"):
                raise self._fail(name, "U8 matrix without its .qs scales")
            return self._container_weight(name, (out_f, in_f))
        if info.dtype not in ("F32", "BF16", "F16", "F8_E4M3"):
            raise self._fail(name, f"dtype {info.dtype} is not supported for a matrix")
        self._expect_shape(info, (out_f, in_f))
        data = self.array(name)
        if info.dtype == "F32":
            return QuantWeight(WeightFormat.F32, (out_f, in_f), data)
        if info.dtype == "BF16":
            return QuantWeight(WeightFormat.BF16, (out_f, in_f), data)
        if info.dtype == "F16":
            return QuantWeight(WeightFormat.F32, (out_f, in_f), data.astype(np.float32))
        return self._fp8_weight(name, data)

    def vector(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 tensor of exactly ``shape`` (norms, biases, router rows).

        F32 is a zero-copy read-only view; BF16 and F16 are converted.
        """
        shape = tuple(shape)
        info = self.info(name)
        self._expect_shape(info, shape)
        data = self.array(name)
        if info.dtype == "F32":
            return data
        if info.dtype == "BF16":
            return quant.bf16_to_f32(data)
        if info.dtype == "F16":
            return data.astype(np.float32)
        raise self._fail(name, f"dtype {info.dtype} is not supported for a float vector")

    def dense_f32(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        """The matrix fully dequantised to float32 [O, I] (read-only view if stored F32)."""
        return quant.dequantize(self.weight(name, shape))

    def _expect_shape(self, info: TensorInfo, shape: tuple[int, ...]) -> None:
        if info.shape != tuple(shape):
            raise self._fail(
                info.name, f"shape {list(info.shape)} but expected {list(shape)} from config"
            )

    # ---- FP8 (HF) -----------------------------------------------------------------

    def _fp8_weight(self, name: str, raw: np.ndarray) -> QuantWeight:
        out_f, in_f = raw.shape
        scale_name = name + "_scale_inv"
        if not self.has(scale_name):
            raise self._fail(name, f"FP8 weight without its {describe(scale_name)}")
        grid = (_ceil_div(out_f, quant.FP8_BLOCK), _ceil_div(in_f, quant.FP8_BLOCK))
        scale = self._block_scales(scale_name, grid)
        return self._fp8_dequant(name, raw, scale)

    def _block_scales(self, scale_name: str, grid: tuple[int, int]) -> np.ndarray:
        info = self.info(scale_name)
        self._expect_shape(info, grid)
        data = self.array(scale_name)
        if info.dtype == "F32":
            return data
        if info.dtype == "BF16":
            return quant.bf16_to_f32(data)
        if info.dtype == "F8_E8M0":
            return quant.e8m0_to_f32(data)
        raise self._fail(scale_name, f"dtype {info.dtype} is not supported for FP8 scales")

    def _fp8_dequant(self, name: str, raw: np.ndarray, scale: np.ndarray) -> QuantWeight:
        out = quant.dequantize_fp8_blocks(raw, scale)
        if not np.isfinite(out).all():
            raise self._fail(name, "non-finite weight (FP8 NaN byte, or non-finite scale)")
        return QuantWeight(WeightFormat.F32, out.shape, out)

    # ---- colibri containers -------------------------------------------------------

    def _group_size_hint(self, name: str) -> int | None:
        f = self._file(name)
        text = f.metadata.get(GROUP_SIZE_KEY)
        if text is None:
            return None
        if not (text.isascii() and text.isdigit() and 0 < len(text) <= 6 and int(text) > 0):
            raise CheckpointError(
                f"{f.path}: __metadata__[{GROUP_SIZE_KEY!r}] = {describe(text, 24)} is not a "
                "positive integer"
            )
        return int(text)

    def _container_weight(self, name: str, shape: tuple[int, int]) -> QuantWeight:
        out_f, in_f = shape
        qs_name = name + ".qs"
        info, qs = self.info(name), self.info(qs_name)
        fmt = resolve_container_format(
            name,
            shape,
            info.nbytes,
            qs.numel,
            qs.dtype,
            stamp=self._stamps.get(name),
            hint=self._group_size_hint(name),
        )
        raw = self._file(name).raw(name)
        if fmt.name == FP8_B128:
            grid = (_ceil_div(out_f, quant.FP8_BLOCK), _ceil_div(in_f, quant.FP8_BLOCK))
            scales = self.array(qs_name).reshape(grid)
            block = quant.e8m0_to_f32(scales) if qs.dtype == "F8_E8M0" else scales
            return self._fp8_dequant(name, raw.reshape(shape), block)
        scales = self.array(qs_name).reshape(-1)
        if not np.isfinite(scales).all():
            raise self._fail(qs_name, "non-finite scale")
        if fmt.name == INT8_ROW:
            return QuantWeight(WeightFormat.Q8, shape, raw.view(np.int8).reshape(shape), scales)
        data = raw.reshape(out_f, quant.q4_row_bytes(in_f))
        if fmt.name == INT4_ROW:
            return QuantWeight(WeightFormat.Q4, shape, data, scales, 0)
        groups = quant.n_groups(in_f, fmt.group_size)
        return QuantWeight(
            WeightFormat.Q4, shape, data, scales.reshape(out_f, groups), fmt.group_size
        )

    # ---- lifetime -----------------------------------------------------------------

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.dir)!r}, {len(self.files)} files, {len(self._where)} tensors)"


def _refuse_incomplete_conversion(root: Path) -> None:
    """`colibri convert` marks DST incomplete until its last file is written."""
    progress = root / CONVERT_PROGRESS_NAME
    if not progress.exists():
        return
    raw = read_small_file(progress, "conversion progress file", CheckpointError)
    if load_json_object(raw, str(progress)).get("complete") is not True:
        raise CheckpointError(
            f"{root}: incomplete conversion (re-run the same `colibri convert` to finish it)"
        )


def _matrix_shape(name: str, shape: object) -> tuple[int, int]:
    """The caller's [O, I] (from config, hence untrusted): two positive ints."""
    if isinstance(shape, list):
        shape = tuple(shape)
    ok = (
        isinstance(shape, tuple)
        and len(shape) == 2
        and all(isinstance(d, int) and not isinstance(d, bool) and 0 < d < 1 << 40 for d in shape)
    )
    if not ok:
        raise ConfigError(f"tensor {describe(name)}: expected shape {shape!r} is not [O, I] > 0")
    return shape  # type: ignore[return-value]
