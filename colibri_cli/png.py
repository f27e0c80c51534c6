"""A heat map written as a PNG with the standard library only (zlib + struct), so the
client needs no imaging package to draw a profile."""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

# dark blue -> purple -> orange -> pale yellow (a small "inferno"-like ramp)
_RAMP = [
    (0, 0, 4),
    (40, 11, 84),
    (101, 21, 110),
    (159, 42, 99),
    (212, 72, 66),
    (245, 125, 21),
    (250, 193, 39),
    (252, 255, 164),
]


def color(x: float) -> tuple[int, int, int]:
    """x in [0, 1] along the ramp."""
    x = min(max(x, 0.0), 1.0) * (len(_RAMP) - 1)
    i = min(int(x), len(_RAMP) - 2)
    f = x - i
    a, b = _RAMP[i], _RAMP[i + 1]
    return tuple(round(a[k] + (b[k] - a[k]) * f) for k in range(3))  # type: ignore[return-value]


def heat_rows(counts: Sequence[Sequence[int]]) -> list[list[float]]:
    """Log-scaled heat in [0, 1] (usage spans orders of magnitude)."""
    top = max((c for row in counts for c in row), default=0)
    scale = math.log1p(top) or 1.0
    return [[math.log1p(c) / scale for c in row] for row in counts]


def write_heatmap(path: Path, counts: Sequence[Sequence[int]], *, cell: int = 8) -> tuple[int, int]:
    """Rows are layers, columns experts; returns (width, height) in pixels."""
    heat = heat_rows(counts)
    n_cols = max((len(r) for r in heat), default=1)
    cell_w = max(1, min(4 * cell, 1024 // max(n_cols, 1)))
    cell = max(2, min(4 * cell, 512 // max(len(heat), 1)))
    width, height = n_cols * cell_w, max(len(heat), 1) * cell
    raw = bytearray()
    for row in heat or [[0.0]]:
        line = bytearray()
        for x in range(n_cols):
            line += bytes(color(row[x] if x < len(row) else 0.0)) * cell_w
        for _ in range(cell):
            raw += b"\x00" + line

    def chunk(tag: bytes, data: bytes) -> bytes:
        body = tag + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    png = b"\x89PNG\r\n\x1a\n" + chunk(
        b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    )
    png += chunk(b"IDAT", zlib.compress(bytes(raw), 9)) + chunk(b"IEND", b"")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)
    return width, height
