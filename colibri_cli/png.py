"""The heat map of a usage profile, as a labelled PNG: experts across, layers down, a
log-scaled colour bar, and a title naming the model, the profile and its selections.

Pillow (with its built-in bitmap font) draws it; the client imports it only here."""

from __future__ import annotations

import math
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
MARGIN_LEFT, MARGIN_TOP, MARGIN_RIGHT, MARGIN_BOTTOM = 64, 40, 96, 44


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


def _ticks(n: int, most: int = 8) -> list[int]:
    """Up to `most` evenly spaced indices of n, the first and last included."""
    if n <= most:
        return list(range(n))
    step = math.ceil((n - 1) / (most - 1))
    return sorted({*range(0, n, step), n - 1})


def write_heatmap(
    path: Path,
    counts: Sequence[Sequence[int]],
    *,
    layers: Sequence[int] | None = None,
    title: str = "",
) -> tuple[int, int]:
    """Rows are layers (labelled with `layers`), columns experts; returns (width, height)."""
    from PIL import Image, ImageDraw

    heat = heat_rows(counts) or [[0.0]]
    layers = list(layers) if layers is not None else list(range(len(heat)))
    n_cols = max(len(r) for r in heat)
    cell_w = max(1, min(24, 768 // max(n_cols, 1)))
    cell_h = max(2, min(24, 512 // len(heat)))
    grid_w, grid_h = n_cols * cell_w, len(heat) * cell_h
    width = MARGIN_LEFT + grid_w + MARGIN_RIGHT
    height = MARGIN_TOP + grid_h + MARGIN_BOTTOM
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    x0, y0 = MARGIN_LEFT, MARGIN_TOP
    for r, row in enumerate(heat):
        for c in range(n_cols):
            left, top = x0 + c * cell_w, y0 + r * cell_h
            fill = color(row[c] if c < len(row) else 0.0)
            draw.rectangle([left, top, left + cell_w - 1, top + cell_h - 1], fill=fill)
    draw.rectangle([x0 - 1, y0 - 1, x0 + grid_w, y0 + grid_h], outline="black")
    for c in _ticks(n_cols):  # experts across
        x = x0 + c * cell_w + cell_w // 2
        draw.line([x, y0 + grid_h, x, y0 + grid_h + 4], fill="black")
        draw.text((x - 6, y0 + grid_h + 6), str(c), fill="black")
    draw.text((x0 + grid_w // 2 - 18, y0 + grid_h + 24), "expert", fill="black")
    for r in _ticks(len(heat)):  # layers down
        y = y0 + r * cell_h + cell_h // 2
        draw.line([x0 - 4, y, x0 - 1, y], fill="black")
        draw.text((x0 - 30, y - 5), str(layers[r] if r < len(layers) else r), fill="black")
    draw.text((4, y0 + grid_h // 2 - 5), "layer", fill="black")
    bar_x = x0 + grid_w + 24  # the colour bar: selections, log scale
    for y in range(grid_h):
        draw.line([bar_x, y0 + y, bar_x + 12, y0 + y], fill=color(1.0 - y / max(grid_h - 1, 1)))
    draw.rectangle([bar_x - 1, y0 - 1, bar_x + 13, y0 + grid_h], outline="black")
    top = max((v for row in counts for v in row), default=0)
    for frac in (1.0, 0.5, 0.0):
        value = round(math.expm1(frac * math.log1p(top)))
        y = y0 + round((1.0 - frac) * (grid_h - 1))
        draw.line([bar_x + 13, y, bar_x + 17, y], fill="black")
        draw.text((bar_x + 19, y - 5), str(value), fill="black")
    draw.text((bar_x - 6, y0 + grid_h + 6), "selections", fill="black")
    draw.text((bar_x - 6, y0 + grid_h + 18), "(log scale)", fill="black")
    draw.text((x0, 12), title, fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    return width, height
