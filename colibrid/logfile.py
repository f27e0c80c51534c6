"""The daemon's logging: one format, and a log file that cannot grow without bound.

`colibrid start` points the detached daemon's stdout and stderr at
`$COLIBRI_HOME/colibrid.log`. The daemon then logs through a rotating handler on that
same file: past `LOG_MAX_BYTES` it becomes `colibrid.log.1` (`.1` -> `.2` ... up to
`LOG_BACKUPS`, the oldest dropped), and stdout and stderr are moved onto the new file,
so a traceback or a C library's message lands in the current log, not a rotated one.
Every file is 0600 (it quotes paths and errors of the user's requests).

In the foreground (`colibrid run` under systemd or launchd, or a terminal) the log is
stderr and whoever reads it rotates it.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LOG_MAX_BYTES = 10 * 1024 * 1024
LOG_BACKUPS = 3
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class PrivateRotatingHandler(logging.handlers.RotatingFileHandler):
    """A RotatingFileHandler whose files are 0600 and which, at each rollover, moves
    the descriptors `follow_fds` (the daemon's stdout and stderr) onto the new file."""

    def __init__(
        self, path: Path, max_bytes: int, backups: int, *, follow_fds: Sequence[int] = ()
    ) -> None:
        self.follow_fds = tuple(follow_fds)
        super().__init__(
            path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8", errors="replace"
        )

    def _open(self) -> Any:
        return open(
            self.baseFilename,
            self.mode,
            encoding=self.encoding,
            errors=self.errors,
            opener=lambda name, flags: os.open(name, flags, 0o600),
        )

    def doRollover(self) -> None:  # noqa: N802 (logging's name)
        super().doRollover()
        if self.stream is None:
            return
        for fd in self.follow_fds:
            try:
                os.dup2(self.stream.fileno(), fd)
            except OSError:
                pass  # keep logging; a stray write then goes to the rotated file


def setup_logging(
    log_path: Path, *, max_bytes: int = LOG_MAX_BYTES, backups: int = LOG_BACKUPS
) -> None:
    """The daemon's root logger (INFO): the rotating log file when stderr is that file
    (the detached daemon), else stderr. Does nothing when logging is already set up
    (as `logging.basicConfig`)."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler: logging.Handler
    if _same_file(sys.stderr, log_path):
        handler = PrivateRotatingHandler(log_path, max_bytes, backups, follow_fds=(1, 2))
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def _same_file(stream: Any, path: Path) -> bool:
    try:
        mine, theirs = os.fstat(stream.fileno()), os.stat(path)
    except (OSError, ValueError, AttributeError):
        return False
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)
