"""The detached daemon's log is rotated (issue 45: it grew without bound): past its size
cap colibrid.log becomes colibrid.log.1 (.2, .3, then dropped), every file 0600, and
stdout/stderr follow onto the new file so a stray traceback lands in the current log."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import logging, os, sys
    from pathlib import Path
    from colibrid.logfile import setup_logging

    log = Path(sys.argv[1])
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # as `colibrid start`
    os.dup2(fd, 2)
    os.close(fd)
    setup_logging(log, max_bytes=4000, backups=2)
    for i in range(400):
        logging.getLogger("colibrid").info("line %d %s", i, "x" * 40)
    print("a stray write to stderr", file=sys.stderr, flush=True)
    """
)


def test_the_daemon_log_is_rotated_and_stays_private(tmp_path: Path) -> None:
    log = tmp_path / "colibrid.log"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["colibrid.log", "colibrid.log.1", "colibrid.log.2"], files
    for name in files:
        path = tmp_path / name
        assert path.stat().st_size <= 4000, name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
    current = log.read_text()
    assert "line 399" in current and current.endswith("a stray write to stderr\n")
    assert "a stray" not in (tmp_path / "colibrid.log.1").read_text()


def test_in_the_foreground_the_log_is_stderr(tmp_path: Path) -> None:
    """Not the log file: nothing is rotated (the service manager keeps the log)."""
    script = SCRIPT.replace("os.dup2(fd, 2)", "pass")
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "colibrid.log")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "line 399" in done.stderr
    assert os.listdir(tmp_path) == ["colibrid.log"]
    assert (tmp_path / "colibrid.log").read_text() == ""
