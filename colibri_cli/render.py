"""Small text helpers for the client: aligned tables, human durations, a progress line."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TextIO, TypeVar

from colibri_protocol.messages import Progress

T = TypeVar("T")


def table(rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressLine:
    """One status line on a terminal, rewritten in place (a long prefill's progress) and
    erased before the answer is written; nothing at all when the stream is not a TTY, so
    pipes and logs only ever see the answer."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.enabled = bool(getattr(stream, "isatty", lambda: False)())
        self.shown = False

    def show(self, text: str) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[K" + text)
            self.stream.flush()
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False

    def around(self, events: Iterable[T]) -> Iterator[T]:
        """A request's events without its PROGRESS lines, which are shown here instead
        (and erased before any other event reaches the caller)."""
        started = time.monotonic()
        for event in events:
            if isinstance(event, Progress):
                self.show(prefill_text(event.done, event.total, time.monotonic() - started))
                continue
            self.clear()
            yield event


def prefill_text(done: int, total: int, elapsed_s: float) -> str:
    share = done / total if total > 0 else 0.0
    return f"(reading the prompt: {100 * share:.0f}%, {duration(elapsed_s)})"


def prefill_rate(extras: dict[str, str]) -> str:
    """`prefill N tok/s` from a DONE's extras, or what happened when nothing was computed
    (the whole prompt came from kept KV)."""
    rate = extras.get("prefill_tok_s", "?")
    try:
        computed = float(rate) > 0
    except ValueError:
        computed = True
    return f"prefill {rate} tok/s" if computed else "prompt fully cached"
