"""Validation of a safetensors header: every tensor entry checked before any data is read.

Why this module exists: the header of a safetensors file is untrusted JSON that says where
each tensor's bytes are. :func:`parse_header` turns it into :class:`TensorInfo` records
only after proving, for every entry, that the dtype is known, the shape is sane (at most
``MAX_DIMS`` dimensions, at most 2^48 elements, a whole number of bytes), the byte range
matches the shape and lies inside the data region, and that no two tensors overlap. Any
problem is one :class:`CheckpointError` line naming the file, the tensor and the problem.
Reading the header bytes and mapping the data is :mod:`colibrid.store.safetensors_file`.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from colibrid.errors import CheckpointError
from colibrid.store.strict_json import describe, load_json_object

MAX_DIMS = 8
MAX_NUMEL = 1 << 48

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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


BITS = {dtype: bits for dtype, (bits, _) in DTYPES.items()}


class TensorInfo(NamedTuple):
    """Where one tensor lives: absolute byte range [file_begin, file_end) in its file.

    A NamedTuple, not a dataclass: a GLM-5 container has ~10^5 of them, built at every
    load, and a tuple is built in well under half the time of a frozen dataclass."""

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


def header_error(path: Path, problem: str, tensor: object = None) -> CheckpointError:
    """The one-line error for a problem in ``path`` (and, if given, one of its tensors)."""
    where = f"{path}" if tensor is None else f"{path}: tensor {describe(tensor)}"
    return CheckpointError(f"{where}: {problem}")


def parse_header(
    path: Path, raw: bytes, size: int, data_start: int
) -> tuple[dict[str, str], dict[str, TensorInfo]]:
    """``__metadata__`` and the validated tensor index of a file of ``size`` bytes whose
    header ``raw`` is followed by the data region at ``data_start``."""
    return _Header(path, size, data_start).parse(raw)


class _Header:
    """The checks of one header, with the file's geometry at hand for error lines."""

    def __init__(self, path: Path, size: int, data_start: int) -> None:
        self.path = path
        self.size = size
        self.data_start = data_start

    def _fail(self, problem: str, tensor: object = None) -> CheckpointError:
        return header_error(self.path, problem, tensor)

    def parse(self, raw: bytes) -> tuple[dict[str, str], dict[str, TensorInfo]]:
        header = load_json_object(raw, f"{self.path}: header", integers_only=True)
        metadata = self._parse_metadata(header.pop("__metadata__", None))
        data_size = self.size - self.data_start
        tensors: dict[str, TensorInfo] = {}
        start = self.data_start
        for name, entry in header.items():
            info = _plain_entry(name, entry, data_size, start)
            tensors[name] = info if info is not None else self._parse_entry(name, entry, data_size)
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


def _plain_entry(name: str, entry: object, data_size: int, start: int) -> TensorInfo | None:
    """The entry's TensorInfo when it passes every check of ``_Header._parse_entry``, else
    None (that method then names the problem). One pass with no calls: the checks are the
    same, made in the order that is cheapest when they all hold, as they do ~10^5 times a
    load (a test compares both on malformed entries)."""
    if type(entry) is not dict:
        return None
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    bits = BITS.get(dtype) if type(dtype) is str else None
    if bits is None or type(shape) is not list or type(offsets) is not list:
        return None
    if len(shape) > MAX_DIMS or len(offsets) != 2:
        return None
    numel = 1
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_NUMEL:
            return None
        numel *= d
        if numel > MAX_NUMEL:
            return None
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end <= data_size:
        return None
    nbytes = numel * bits
    if nbytes % 8 or end - begin != nbytes >> 3:
        return None
    return TensorInfo(name, dtype, tuple(shape), start + begin, start + end, nbytes >> 3)
