"""A validated, zero-copy safetensors reader.

Why our own reader: the expert store needs the absolute byte range of every tensor
(to coalesce an expert's three matrices into one read, docs/formats.md), and model files come
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

This module owns the file: opening it safely, reading and capping the header bytes, and
the mapped data. What the header says is checked in :mod:`colibrid.store.safetensors_header`,
strict JSON in :mod:`colibrid.store.strict_json`.
"""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path
from types import TracebackType

import numpy as np

from colibrid.errors import CheckpointError
from colibrid.store.safetensors_header import DTYPES, TensorInfo, header_error, parse_header

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""Headers above this are refused (the safetensors library uses the same cap)."""

PARSE_BUDGET_BYTES = 512 * 1024 * 1024
"""Refuse headers whose parsed Python objects could exceed this (see _parse_cost)."""


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
            self.metadata, self.tensors = parse_header(
                self.path, header, self.size, self.data_start
            )
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> SafetensorsFile:
        return cls(path)

    # ---- opening and header -------------------------------------------------------

    def _fail(self, problem: str, tensor: object = None) -> CheckpointError:
        return header_error(self.path, problem, tensor)

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
