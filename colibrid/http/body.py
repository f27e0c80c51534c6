"""Reading and decoding a request body: size limit, deadline, bounded JSON, off the loop.

Why each rule:

- the size limit is checked against ``content-length`` first and then while reading, so
  an oversized body is refused before it is buffered;
- the whole body must arrive within ``http_body_timeout_s``: a client that declares
  4 MB and sends ten bytes would otherwise hold its connection and buffer for as long as
  it likes (408, and the connection is closed because its framing is lost);
- JSON goes through `loads_bounded`, so 100,000 nested ``[`` is a 400, not a
  RecursionError (500);
- a large body is decoded and turned into a plan in a worker thread: decoding 4 MB, the
  depth walk and the per-message validation are hundreds of milliseconds of Python that
  would otherwise stall every other request, /health included. Small bodies stay on the
  loop, where a thread hop would cost more than the work.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio
from colibri_protocol.bounded_json import JsonTooDeep, loads_bounded

from colibrid.http.errors import ApiError, bad_request

OFF_LOOP_BYTES = 64 * 1024  # bodies above this are decoded in a worker thread
DECODE_THREADS = 2  # at most this many large bodies decode at once (memory, cores)
T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]


async def read_body(
    receive: Receive, headers: dict[bytes, bytes], *, limit: int, timeout_s: float
) -> bytes:
    """The request body, or a 413 (too large), 408 (too slow) or 400 (client left)."""
    too_large = ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
    length = headers.get(b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(timeout_s) as deadline:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise bad_request("the client left before sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body"):
                break
    if deadline.cancelled_caught:
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout_s:g} s "
            f"(got {size} bytes; http_body_timeout_s)",
            code="request_timeout",
            headers=(("connection", "close"),),
        )
    return b"".join(chunks)


def decode_json(data: bytes) -> Any:
    """The body as JSON; a 400 naming the problem for anything else (never a 500)."""
    try:
        return loads_bounded(data)
    except JsonTooDeep as exc:
        raise bad_request(f"the body nests too deeply: {exc}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, huge int literals
        raise bad_request(f"the body is not valid JSON: {exc}") from None


class Decoder:
    """Runs body-sized work inline for small bodies, in a bounded thread pool for large."""

    def __init__(self, threads: int = DECODE_THREADS) -> None:
        self._threads = threads
        self._limiter: trio.CapacityLimiter | None = None  # made inside the trio run

    async def run(self, size: int, fn: Callable[[], T]) -> T:
        if size <= OFF_LOOP_BYTES:
            return fn()
        if self._limiter is None:
            self._limiter = trio.CapacityLimiter(self._threads)
        return await trio.to_thread.run_sync(fn, limiter=self._limiter)
