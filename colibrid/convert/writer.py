"""A streaming safetensors shard writer that keeps tensors in the order we choose.

Why our own writer: the expert store reads an expert with one coalesced read, which only
works if the expert's three matrices (and, right after them, their three ``.qs`` scale
arrays) are adjacent in the file (docs/formats.md). The safetensors library orders tensors
itself and needs every tensor in memory at once; here the header is computed up front
from the planned sizes and the data is streamed chunk by chunk, so converting a tensor
never needs more than one row block of it in memory.

The file is a plain safetensors file (8-byte little-endian header length, JSON header
padded with spaces so the data starts 8-byte aligned, tensors back to back with no gap),
readable by ``safetensors.safe_open``. It is written to a hidden temporary name in the
destination folder, fsynced, and renamed into place: a shard either exists complete or
not at all. Any OS error (ENOSPC, EFBIG) removes the temporary file and surfaces as one
:class:`ConvertError` line.

The writer sees every byte, so it also hashes them as they go by (the whole file and each
tensor, :mod:`colibrid.store.integrity`): the digests the manifest records cost no second
pass over the data.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibrid.errors import ConvertError
from colibrid.store.integrity import ShardDigest, new_hasher

ALIGN = 8
WRITE_BUFFER = 8 << 20


@dataclass(frozen=True)
class Entry:
    """One tensor of a shard as planned: name, safetensors dtype, shape, byte size."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def header_bytes(entries: Sequence[Entry], metadata: dict[str, str]) -> bytes:
    """The length prefix + JSON header for ``entries`` laid out in the given order."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for e in entries:
        if e.name in header or e.name == "__metadata__":
            raise ValueError(f"duplicate tensor {e.name!r} in shard plan")
        header[e.name] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    text += b" " * (-(8 + len(text)) % ALIGN)
    return struct.pack("<Q", len(text)) + text


def shard_size(entries: Sequence[Entry], metadata: dict[str, str]) -> int:
    return len(header_bytes(entries, metadata)) + sum(e.nbytes for e in entries)


def temp_path(final: Path) -> Path:
    """The hidden name a shard is written under until it is complete (never globbed as
    ``*.safetensors``)."""
    return final.with_name(f".{final.name}.partial")


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class ShardWriter:
    """Writes one planned shard; tensors must arrive in plan order, each exactly sized.

    Usage: ``w = ShardWriter(path, entries, meta)``, then ``w.write(name, chunk)`` any
    number of times per tensor (chunks of one tensor in order), then ``w.finish()``; on
    any failure call ``w.abort()`` (a context manager does it).
    """

    def __init__(self, final: Path, entries: Sequence[Entry], metadata: dict[str, str]) -> None:
        self.final = Path(final)
        self.tmp = temp_path(self.final)
        self.entries = list(entries)
        self._index = 0
        self._left = self.entries[0].nbytes if self.entries else 0
        self.written = 0
        self._file_hash = new_hasher()
        self._tensor_hash = new_hasher()
        self._digests: dict[str, int] = {}
        self.digests: ShardDigest | None = None  # set by finish()
        try:
            self.tmp.unlink(missing_ok=True)
            self._fh = open(self.tmp, "wb", buffering=WRITE_BUFFER)  # noqa: SIM115
        except OSError as exc:
            raise self._os_error(exc) from None
        header = header_bytes(self.entries, metadata)
        self._io(self._fh.write, header)
        self._file_hash.update(header)
        self._header_bytes = len(header)

    def _os_error(self, exc: OSError) -> ConvertError:
        return ConvertError(f"writing {self.final}: {exc.strerror or exc}")

    def _io(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        try:
            fn(*args)
        except OSError as exc:
            self.abort()
            raise self._os_error(exc) from None

    def write(self, name: str, chunk: np.ndarray | bytes) -> None:
        """Append bytes of tensor ``name`` (must be the current tensor of the plan)."""
        while self._left == 0 and self._index < len(self.entries) - 1:
            self._next_tensor()
        current = self.entries[self._index] if self.entries else None
        if current is None or current.name != name:
            expected = current.name if current else "nothing"
            raise RuntimeError(f"shard plan order: got {name!r}, expected {expected!r}")
        data = memoryview(
            np.ascontiguousarray(chunk) if isinstance(chunk, np.ndarray) else chunk
        ).cast("B")
        if data.nbytes > self._left:
            raise RuntimeError(f"tensor {name!r}: {data.nbytes} bytes exceed the planned size")
        self._io(self._fh.write, data)
        self._file_hash.update(data)
        self._tensor_hash.update(data)
        self._left -= data.nbytes
        self.written += data.nbytes

    def _next_tensor(self) -> None:
        """The current tensor is complete: record its digest, move to the next."""
        self._digests[self.entries[self._index].name] = self._tensor_hash.intdigest()
        self._tensor_hash.reset()
        self._index += 1
        self._left = self.entries[self._index].nbytes

    def finish(self) -> None:
        """Check every planned byte arrived, flush, fsync, rename into place; the shard's
        digests are then in ``digests``."""
        missing = self._left + sum(e.nbytes for e in self.entries[self._index + 1 :])
        if missing:
            self.abort()
            raise RuntimeError(f"{self.final.name}: {missing} planned bytes never written")
        while self._index < len(self.entries) - 1:  # trailing empty tensors
            self._next_tensor()
        if self.entries:
            self._digests[self.entries[self._index].name] = self._tensor_hash.intdigest()
        self._io(self._fh.flush)
        self._io(os.fsync, self._fh.fileno())
        self._fh.close()
        try:
            os.replace(self.tmp, self.final)
        except OSError as exc:
            self.abort()
            raise self._os_error(exc) from None
        fsync_dir(self.final.parent)
        size = self._header_bytes + self.written
        whole = self._file_hash.intdigest()
        self.digests = ShardDigest(self.final.name, size, whole, self._digests)

    def abort(self) -> None:
        try:
            self._fh.close()
        except (OSError, AttributeError):
            pass
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # type: ignore[no-untyped-def]
        if exc_type is not None:
            self.abort()


def write_atomic(path: Path, data: bytes) -> None:
    """Small files (progress, manifest, config copies): temp + fsync + rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConvertError(f"writing {path}: {exc.strerror or exc}") from None
    fsync_dir(path.parent)
