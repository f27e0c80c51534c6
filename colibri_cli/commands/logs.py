"""`colibri logs [-f] [-n N]`: the detached daemon's log ($COLIBRI_HOME/colibrid.log): one
line per finished request (id, client, prompt and generated tokens, tok/s, its share of
the disk and memory probes and of the roofline, finish), the models it loads and
unloads, warnings. `-f` keeps printing lines as they are written.

A daemon run in the foreground (`colibrid run`, the service unit) logs to its terminal or
to the journal instead: `journalctl --user -u colibrid` on Linux."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from colibri_protocol import home

FOLLOW_POLL_S = 0.25


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri logs", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "-n", "--lines", type=int, default=50, metavar="N", help="last N lines (default 50)"
    )
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    return p


def log_path() -> Path:
    return home.colibri_home() / "colibrid.log"


def tail(path: Path, n: int) -> tuple[list[str], int]:
    """The last `n` lines and the offset the file ended at."""
    with open(path, "rb") as f:
        lines = deque((raw.decode("utf-8", "replace") for raw in f), maxlen=max(n, 0))
        return list(lines), f.tell()


def follow(path: Path, offset: int, out=sys.stdout) -> None:  # type: ignore[no-untyped-def]
    """Print what is appended from `offset` on; a log that was truncated or replaced is
    read again from its start."""
    inode = os.stat(path).st_ino
    pending = b""
    while True:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            time.sleep(FOLLOW_POLL_S)
            continue
        if st.st_ino != inode or st.st_size < offset:
            inode, offset, pending = st.st_ino, 0, b""
        if st.st_size > offset:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            offset += len(data)
            *complete, pending = (pending + data).split(b"\n")
            for raw in complete:
                out.write(raw.decode("utf-8", "replace") + "\n")
            out.flush()
        else:
            time.sleep(FOLLOW_POLL_S)


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    path = log_path()
    if not path.is_file():
        print(
            f"colibri logs: no log at {path}: only a daemon started in the background "
            "(`colibrid start`, or by `colibri ask`) writes one; `colibrid run` logs to its "
            "terminal, and the service to the journal (`journalctl --user -u colibrid`)",
            file=sys.stderr,
        )
        return 1
    lines, offset = tail(path, args.lines)
    sys.stdout.write("".join(line if line.endswith("\n") else line + "\n" for line in lines))
    sys.stdout.flush()
    if args.follow:
        try:
            follow(path, offset)
        except KeyboardInterrupt:
            return 0
    return 0
