"""Keeping Rust's panic reports off a command's stderr, where its own line says it all.

A native library (tokenizers, llguidance) that panics prints a report on file
descriptor 2 before pyo3 raises the panic in Python: a "thread '...' panicked at
<source path>:" header, the message, a note about RUST_BACKTRACE (and a whole backtrace
when that variable is set, as it is in many developer shells). `contain_panics` already
turns the panic into one `colibrid: error: ...` line that quotes the message, so a
one-shot command (`colibrid generate`) routes descriptor 2 through a pipe whose reader
drops those reports and passes every other line on unchanged. Line-based: a line is
passed on when it is complete (or when the command ends).
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Callable

_HEAD = re.compile(rb"^thread '.*' (\(\d+\) )?panicked at ")
_TAIL = re.compile(rb"^note: (run with `RUST_BACKTRACE|Some details are omitted)")
_FRAME = re.compile(rb"^(stack backtrace:|\s+\d+: |\s+at )")


class _Filter:
    """Feeds lines; `out` gets every line that is not part of a panic report."""

    def __init__(self, out: Callable[[bytes], None]) -> None:
        self._out = out
        self._in_report = False
        self._blank: bytes | None = None  # a blank line held: a report starts with one

    def line(self, line: bytes) -> None:
        if self._in_report:
            if _TAIL.match(line):
                self._in_report = False
            return
        if _HEAD.match(line):
            self._in_report, self._blank = True, None
            return
        if _FRAME.match(line) and self._blank is None:
            return  # a backtrace's stray frame after its report ended
        if self._blank is not None:
            self._out(self._blank)
            self._blank = None
        if not line.strip():
            self._blank = line
            return
        self._out(line)

    def end(self) -> None:
        if self._blank is not None and not self._in_report:
            self._out(self._blank)
        self._blank = None


def quiet_panic_reports() -> Callable[[], None]:
    """Route descriptor 2 through the filter from now on; returns the function that puts
    descriptor 2 back (flushing what is pending), for the command's end."""
    os.environ["RUST_BACKTRACE"] = "0"  # read at a panic: a short report, if one escapes
    sys.stderr.flush()
    original = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def write(data: bytes) -> None:
        try:
            os.write(original, data)
        except OSError:
            pass

    def pump() -> None:
        lines = _Filter(write)
        pending = b""
        while chunk := os.read(read_end, 65536):
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for line in complete:
                lines.line(line + b"\n")
        if pending:
            lines.line(pending)
        lines.end()
        os.close(read_end)

    thread = threading.Thread(target=pump, name="stderr", daemon=True)
    thread.start()

    def restore() -> None:
        try:
            sys.stderr.flush()
        except OSError:
            pass
        os.dup2(original, 2)  # the pipe's last write end closes: the reader drains and ends
        thread.join(timeout=2.0)
        os.close(original)

    return restore
