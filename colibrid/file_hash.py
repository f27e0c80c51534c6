"""A file's checksums, read once in blocks, for every caller that checks a download or
fingerprints an input: SHA-256 (the demo's wheel, llama.cpp's sdist, a requant's profile
and manifest) and CRC-32 (the demo's GGUF against what its wheel records).

Streamed in 1 MiB blocks rather than `hashlib.file_digest`, which needs Python 3.11 where
colibri supports 3.10."""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterator
from pathlib import Path

BLOCK = 1 << 20


def _blocks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while block := fh.read(BLOCK):
            yield block


def sha256_of(path: Path) -> str:
    """The hex SHA-256 of the file at ``path``."""
    h = hashlib.sha256()
    for block in _blocks(path):
        h.update(block)
    return h.hexdigest()


def crc32_of(path: Path) -> int:
    """The CRC-32 of the file at ``path``, as a zip archive records its members'."""
    crc = 0
    for block in _blocks(path):
        crc = zlib.crc32(block, crc)
    return crc
