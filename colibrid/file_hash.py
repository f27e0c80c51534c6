"""One SHA-256 of a file's bytes for every caller that checks a download or fingerprints an
input (the demo's wheel, llama.cpp's sdist, a requant's profile and manifest).

Streamed in 1 MiB blocks rather than `hashlib.file_digest`, which needs Python 3.11 where
colibri supports 3.10."""

from __future__ import annotations

import hashlib
from pathlib import Path

BLOCK = 1 << 20


def sha256_of(path: Path) -> str:
    """The hex SHA-256 of the file at ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(BLOCK):
            h.update(block)
    return h.hexdigest()
