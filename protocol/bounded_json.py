"""JSON from the network, parsed with a nesting limit.

Why: Python's parser recurses once per ``[`` or ``{``, so a body of 100,000 brackets raises
`RecursionError` (an HTTP 500, or a SERVE connection handler that dies without an ERROR
line). Real requests nest a handful of levels (a tool schema perhaps twenty), so anything
deeper than `MAX_DEPTH` is refused as a plain bad request, the same way on HTTP and SERVE.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64  # containers inside containers; a JSON schema of a tool fits in a third of it


class JsonTooDeep(ValueError):
    """The document nests containers deeper than the limit."""


def loads_bounded(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads` that refuses documents nested deeper than `max_depth` with a
    `ValueError` (a `JsonTooDeep`), never a `RecursionError`. Other malformed input raises
    `json.JSONDecodeError` (also a `ValueError`) as `json.loads` does."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JsonTooDeep(f"JSON nested deeper than {max_depth} levels") from None
    if _depth_exceeds(value, max_depth):
        raise JsonTooDeep(f"JSON nested deeper than {max_depth} levels")
    return value


def _depth_exceeds(value: Any, max_depth: int) -> bool:
    """Whether containers nest deeper than `max_depth` (iterative: no recursion limit)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
