"""Server-sent events framing (``text/event-stream``): one ``data:`` line of JSON per
event, a blank line after each, OpenAI's ``data: [DONE]`` terminator and Anthropic's
named events (``event: <type>``), and comments that keep a quiet stream alive."""

from __future__ import annotations

import json
from typing import Any

HEADERS = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)
DONE = b"data: [DONE]\n\n"


def data(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def named(event: str, payload: Any) -> bytes:
    """An Anthropic-style event: its type both as the SSE event name and in the JSON."""
    return f"event: {event}\n".encode() + data({"type": event, **payload})


def comment(text: str) -> bytes:
    """A comment line: every SSE client skips it, and it keeps a quiet stream (a long
    prefill) from looking dead to proxies and client read timeouts."""
    return b": " + text.replace("\n", " ").encode() + b"\n\n"
