"""Newline-delimited JSON framing (``application/x-ndjson``), what Ollama's API streams:
one JSON object a line, each flushed as it is made, an error as a line ``{"error": …}``
once the status is out (Ollama's clients raise it as they read)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

HEADERS = (
    (b"content-type", b"application/x-ndjson"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)


def line(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False).encode() + b"\n"


def lines(payloads: Iterable[Any]) -> bytes:
    return b"".join(line(p) for p in payloads)
