"""Damaging a container's bytes in place, the way a bad disk or a bad copy would: what the
digest checks (docs/formats.md, "Digests") must catch."""

from __future__ import annotations

import json
import mmap
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np


def tensors(shard: Path) -> dict[str, tuple[int, int]]:
    """{name: (file_begin, file_end)} from the shard's header."""
    with open(shard, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return {
        k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in header.items()
    }


def edit(shard: Path, name: str, change: Callable[[np.ndarray], None]) -> None:
    """Apply ``change`` to tensor ``name``'s bytes (a writable uint8 view) in the file."""
    begin, end = tensors(shard)[name]
    with open(shard, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:
        change(np.ndarray((end - begin,), np.uint8, mm, begin))
        mm.flush()


def flip(nbytes: int) -> Callable[[np.ndarray], None]:
    """Invert up to ``nbytes`` bytes in the middle of a tensor."""

    def change(b: np.ndarray) -> None:
        n = min(nbytes, b.size)
        at = (b.size - n) // 2
        b[at : at + n] ^= 0xFF

    return change


def zero(nbytes: int) -> Callable[[np.ndarray], None]:
    """Zero up to ``nbytes`` bytes at a tensor's start."""

    def change(b: np.ndarray) -> None:
        b[: min(nbytes, b.size)] = 0

    return change


def fill_f32(value: float) -> Callable[[np.ndarray], None]:
    """Overwrite an F32 tensor (scales) with a finite ``value`` everywhere."""

    def change(b: np.ndarray) -> None:
        b.view(np.float32)[:] = np.float32(value)

    return change


def copy_container(src: Path, dst: Path) -> Path:
    """A private copy to damage (the shards copied, never linked)."""
    shutil.copytree(src, dst, symlinks=False)
    return dst


def shard_of(container: Path, name: str) -> Path:
    for shard in sorted(container.glob("*.safetensors")):
        if name in tensors(shard):
            return shard
    raise KeyError(name)
