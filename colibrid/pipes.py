"""Both entry points (`colibri`, `colibrid`) end quietly when the reader of their output
goes away: `colibri ps | head -3`, `colibri ask ... | head -c 20`.

Python ignores SIGPIPE, so the next write to a pipe whose reader closed raises
BrokenPipeError wherever it happens (a command's print, or the interpreter's final flush
of stdout, which prints "Exception ignored" and exits 120). The convention kept here is
the shell tools': stop at once, print nothing more, and exit 141 (128 + SIGPIPE), what
`yes | head -1` reports for `yes` under `set -o pipefail`; a plain pipeline's status is the
last command's, so scripts see nothing. Requests in flight end with the client: the
daemon cancels a request whose connection closes.

stdlib only: the light client imports it without pulling in the daemon side.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

READER_GONE = 141  # 128 + SIGPIPE, as a tool killed by the signal reports


def quiet_when_reader_leaves(run: Callable[[], int]) -> int:
    """`run()`'s exit code, or READER_GONE with nothing printed when stdout's (or
    stderr's) reader went away during it or before its output was flushed."""
    try:
        try:
            return run()
        finally:  # also after --help's SystemExit: a reader that left shows here,
            sys.stdout.flush()  # not in the interpreter's exit flush
    except BrokenPipeError:
        _silence()
        return READER_GONE


def _silence() -> None:
    """Point stdout and stderr at /dev/null: whatever is still buffered, and the
    interpreter's last flush, go nowhere instead of raising again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                os.dup2(devnull, stream.fileno())
            except (AttributeError, OSError, ValueError):  # replaced or closed: nothing to do
                pass
    finally:
        os.close(devnull)
