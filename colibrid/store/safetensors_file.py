"""A validated, zero-copy safetensors reader.

Why our own reader: the expert store needs the absolute byte range of every tensor
(to coalesce an expert's three matrices into one read, DESIGN §5), and model files come
from untrusted mirrors. Upstream colibri had six memory-safety advisories from malicious
safetensors and config.json files, so every field of the header is checked before any
byte of tensor data is touched, and every malformed input ends in one
:class:`CheckpointError` line that names the file, the tensor and the problem.

Guarantees for any input file:
  * no read outside the file: every tensor's range lies inside the data region;
  * no allocation driven by the header beyond the (capped) header itself;
  * no hang: the file must be a regular file (a FIFO or device is refused before
    any read), and parsing is linear in the header size;
  * tensors never overlap, element counts never overflow.

Tensor data is reached through one read-only ``mmap`` of the whole file, mapped lazily on
the first :meth:`SafetensorsFile.array` call; arrays are views, never copies.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from colibrid.errors import CheckpointError, ColibriError

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""Headers above this are refused (the safetensors library uses the same cap)."""

PARSE_BUDGET_BYTES = 512 * 1024 * 1024
"""Refuse headers whose parsed Python objects could exceed this (see _parse_cost)."""

MAX_DIMS = 8
MAX_NUMEL = 1 << 48
MAX_INT_DIGITS = 24
"""Longer JSON integer literals are refused before conversion (no quadratic int())."""

# dtype -> (bits per element, numpy dtype of the raw view). Types numpy cannot
# represent are exposed as their raw storage: BF16 as uint16, FP8 as uint8; sub-byte
# types (F4, F6) as a flat uint8 byte array.
DTYPES: dict[str, tuple[int, np.dtype | None]] = {
    "BOOL": (8, np.dtype(np.bool_)),
    "U8": (8, np.dtype(np.uint8)),
    "I8": (8, np.dtype(np.int8)),
    "F8_E4M3": (8, np.dtype(np.uint8)),
    "F8_E5M2": (8, np.dtype(np.uint8)),
    "F8_E8M0": (8, np.dtype(np.uint8)),
    "U16": (16, np.dtype("<u2")),
    "I16": (16, np.dtype("<i2")),
    "F16": (16, np.dtype("<f2")),
    "BF16": (16, np.dtype("<u2")),
    "U32": (32, np.dtype("<u4")),
    "I32": (32, np.dtype("<i4")),
    "F32": (32, np.dtype("<f4")),
    "U64": (64, np.dtype("<u8")),
    "I64": (64, np.dtype("<i8")),
    "F64": (64, np.dtype("<f8")),
    "C64": (64, np.dtype("<c8")),
    "F4": (4, None),
    "F6_E2M3": (6, None),
    "F6_E3M2": (6, None),
}


def describe(name: object, limit: int = 80) -> str:
    """A tensor/key name made safe for a one-line message (quoted, escaped, truncated)."""
    text = repr(name)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _JsonReject(Exception):
    """Raised from inside json hooks; turned into the caller's error class."""


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _JsonReject(f"duplicate key {describe(key)}")
            seen.add(key)
    return obj


def _bounded_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:
        raise _JsonReject(f"integer literal with {len(text)} digits")
    return int(text)


def _reject_constant(text: str) -> object:
    raise _JsonReject(f"non-standard JSON constant {text}")


def _reject_float(text: str) -> object:
    raise _JsonReject(f"non-integer number {text[:24]}")


def _parse_cost(raw: bytes) -> int:
    """An upper estimate of the memory json.loads needs for ``raw``, at C speed.

    JSON is far denser than Python objects: ``0,`` is 2 bytes of text but 8+ bytes of
    list slot, ``{}`` 3 bytes but ~64 bytes of dict. Pricing every container and every
    separated value lets us refuse a hostile header before allocating for it, while a
    real header (long tensor names, ~10 values per entry) costs a few times its size.
    """
    containers = raw.count(b"{") + raw.count(b"[")
    values = raw.count(b",") + raw.count(b":")
    return 64 * containers + 40 * values + 2 * len(raw)


def load_json_object(
    raw: bytes,
    what: str,
    error: type[ColibriError] = CheckpointError,
    *,
    integers_only: bool = False,
) -> dict[str, object]:
    """Parse untrusted JSON that must be an object, strictly, as one ``error`` line.

    Strict means: UTF-8 only, no duplicate keys (two readers could pick different
    values), no NaN/Infinity, no absurd integer literals, bounded nesting; with
    ``integers_only`` (safetensors headers) no fractional numbers either.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what}: not valid UTF-8 (byte {exc.start})") from None
    try:
        obj = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_int=_bounded_int,
            parse_constant=_reject_constant,
            parse_float=_reject_float if integers_only else None,
        )
    except _JsonReject as exc:
        raise error(f"{what}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise error(
            f"{what}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except RecursionError:
        raise error(f"{what}: JSON nested too deeply") from None
    except ValueError as exc:  # e.g. a float literal Python refuses
        raise error(f"{what}: invalid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise error(f"{what}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: absolute byte range [file_begin, file_end) in its file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file_begin: int
    file_end: int
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class SafetensorsFile:
    """One safetensors file, header fully validated at open, data mapped lazily.

    Arrays returned by :meth:`array` stay valid after :meth:`close` (they keep the
    mapping alive); closing only drops this object's references.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._mmap: mmap.mmap | None = None
        self._fd: int | None = None
        self._fd = self._open_regular_file()
        try:
            self.size = os.fstat(self._fd).st_size
            header = self._read_header()
            self.data_start = 8 + len(header)
            self.metadata, self.tensors = self._parse_header(header)
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> SafetensorsFile:
        return cls(path)

    # ---- opening and header -------------------------------------------------------

    def _fail(self, problem: str, tensor: object = None) -> CheckpointError:
        where = f"{self.path}" if tensor is None else f"{self.path}: tensor {describe(tensor)}"
        return CheckpointError(f"{where}: {problem}")

    def _open_regular_file(self) -> int:
        # O_NONBLOCK so that a FIFO planted in place of a shard cannot block open().
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise self._fail("file not found") from None
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
            raise self._fail(f"cannot open ({getattr(exc, 'strerror', exc)})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise self._fail("not a regular file")
        return fd

    def _read_exact(self, offset: int, n: int) -> bytes:
        assert self._fd is not None
        chunks: list[bytes] = []
        got = 0
        while got < n:
            chunk = os.pread(self._fd, n - got, offset + got)
            if not chunk:
                raise self._fail(f"file ended early (read {got} of {n} bytes at {offset})")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _read_header(self) -> bytes:
        if self.size < 8:
            raise self._fail(f"too small for a safetensors file ({self.size} bytes)")
        n = int.from_bytes(self._read_exact(0, 8), "little")
        if n == 0:
            raise self._fail("header length is 0")
        if n > MAX_HEADER_BYTES:
            raise self._fail(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap")
        if n > self.size - 8:
            raise self._fail(f"header length {n} runs past the end of the file ({self.size} bytes)")
        raw = self._read_exact(8, n)
        cost = _parse_cost(raw)
        if cost > PARSE_BUDGET_BYTES:
            raise self._fail(
                f"header would take ~{cost >> 20} MiB to parse (cap {PARSE_BUDGET_BYTES >> 20} MiB)"
            )
        return raw

    def _parse_header(self, raw: bytes) -> tuple[dict[str, str], dict[str, TensorInfo]]:
        header = load_json_object(raw, f"{self.path}: header", integers_only=True)
        metadata = self._parse_metadata(header.pop("__metadata__", None))
        data_size = self.size - self.data_start
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            tensors[name] = self._parse_entry(name, entry, data_size)
        self._check_overlaps(tensors)
        return metadata, tensors

    def _parse_metadata(self, meta: object) -> dict[str, str]:
        if meta is None:
            return {}
        if not isinstance(meta, dict):
            raise self._fail(f"__metadata__ must be an object, got {type(meta).__name__}")
        for key, value in meta.items():
            if not isinstance(value, str):
                raise self._fail(f"__metadata__ value for {describe(key)} is not a string")
        return meta

    def _parse_entry(self, name: str, entry: object, data_size: int) -> TensorInfo:
        if not isinstance(entry, dict):
            raise self._fail("entry is not an object", name)
        for key in ("dtype", "shape", "data_offsets"):
            if key not in entry:
                raise self._fail(f"missing {key!r}", name)
        dtype = entry["dtype"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise self._fail(f"unknown dtype {describe(dtype, 24)}", name)
        shape = self._parse_shape(name, entry["shape"])
        numel = 1
        for d in shape:
            numel *= d  # each d <= MAX_NUMEL and we stop as soon as it exceeds it
            if numel > MAX_NUMEL:
                raise self._fail(f"shape {list(shape)} has more than 2^48 elements", name)
        bits = DTYPES[dtype][0]
        if (numel * bits) % 8:
            raise self._fail(f"{numel} elements of {dtype} are not a whole number of bytes", name)
        nbytes = numel * bits // 8
        begin, end = self._parse_offsets(name, entry["data_offsets"])
        if end - begin != nbytes:
            raise self._fail(
                f"holds {end - begin} bytes but {dtype} {list(shape)} needs {nbytes}", name
            )
        if end > data_size:
            raise self._fail(
                f"data_offsets [{begin}, {end}] run past the data region ({data_size} bytes)",
                name,
            )
        return TensorInfo(
            name=name,
            dtype=dtype,
            shape=shape,
            file_begin=self.data_start + begin,
            file_end=self.data_start + end,
            nbytes=nbytes,
        )

    def _parse_shape(self, name: str, shape: object) -> tuple[int, ...]:
        if not isinstance(shape, list):
            raise self._fail("shape is not a list", name)
        if len(shape) > MAX_DIMS:
            raise self._fail(f"shape has {len(shape)} dimensions (max {MAX_DIMS})", name)
        for d in shape:
            if not _is_int(d) or d < 0 or d > MAX_NUMEL:
                raise self._fail(f"bad dimension {describe(d, 32)} in shape", name)
        return tuple(shape)

    def _parse_offsets(self, name: str, offsets: object) -> tuple[int, int]:
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise self._fail("data_offsets is not a [begin, end] pair", name)
        begin, end = offsets
        if not (_is_int(begin) and _is_int(end)) or begin < 0 or end < begin:
            raise self._fail(f"bad data_offsets {describe(offsets, 48)}", name)
        return begin, end

    def _check_overlaps(self, tensors: dict[str, TensorInfo]) -> None:
        spans = sorted(
            (t for t in tensors.values() if t.nbytes), key=lambda t: (t.file_begin, t.file_end)
        )
        for prev, cur in zip(spans, spans[1:], strict=False):
            if cur.file_begin < prev.file_end:
                raise self._fail(f"overlaps tensor {describe(prev.name)}", cur.name)

    # ---- data ---------------------------------------------------------------------

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise self._fail("not in this file", name) from None

    def _buffer(self) -> mmap.mmap:
        if self._mmap is None:
            if self._fd is None:
                raise self._fail("file is closed")
            if self.size == 0:
                raise self._fail("empty file")
            self._mmap = mmap.mmap(self._fd, self.size, access=mmap.ACCESS_READ)
        return self._mmap

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only flat uint8 view (any dtype)."""
        info = self.info(name)
        if info.nbytes == 0:
            return _readonly(np.empty(0, dtype=np.uint8))
        return np.frombuffer(self._buffer(), np.uint8, info.nbytes, info.file_begin)

    def array(self, name: str) -> np.ndarray:
        """A read-only zero-copy view with the tensor's shape.

        BF16 comes back as uint16, FP8 types as uint8 (raw bytes); sub-byte types (F4,
        F6) as a flat uint8 array of their packed bytes.
        """
        info = self.info(name)
        np_dtype = DTYPES[info.dtype][1]
        if np_dtype is None:
            return self.raw(name)
        if info.nbytes == 0:
            return _readonly(np.empty(info.shape, dtype=np_dtype))
        flat = np.frombuffer(self._buffer(), np_dtype, info.numel, info.file_begin)
        return flat.reshape(info.shape)

    def close(self) -> None:
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # arrays still view it; the mapping is released with them
            self._mmap = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self.tensors)} tensors)"


def _readonly(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr
