"""Out of file descriptors (issue 45): the daemon raises its soft RLIMIT_NOFILE at start,
and a flood of connections past the limit (SERVE and HTTP) costs a line or two of log,
not a traceback every 100 ms; once the connections close, it answers again."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from daemon_helpers import Home, free_port, wait_for

SOFT, HARD = 48, 96  # the daemon needs ~40 descriptors of its own when idle


def _low_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, HARD))


def _log_size(home: Home) -> int:
    return (home.path / "colibrid.log").stat().st_size


def _flood(path: Path, port: int, count: int) -> list[socket.socket]:
    """Connections the daemon has to accept: more than it has descriptors for."""
    held = []
    for i in range(count):
        if i % 4:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: object = str(path)
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            target = ("127.0.0.1", port)
        sock.setblocking(False)
        try:
            sock.connect(target)
        except BlockingIOError:
            pass  # TCP: in progress; a Unix socket: its backlog is full
        except OSError:
            sock.close()
            continue
        held.append(sock)
    return held


@pytest.mark.skipif(sys.platform != "linux", reason="counts /proc/PID/fd")
def test_a_flood_past_the_fd_limit_keeps_the_log_small(chat_model: Path, tmp_path: Path) -> None:
    port = free_port()
    home = Home(tmp_path / "home", chat_model, http=f"127.0.0.1:{port}", shutdown_grace_s=1.0)
    started = subprocess.run(
        [sys.executable, "-m", "colibrid", "start"],
        env=home.env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_low_limit,
    )
    try:
        assert started.returncode == 0, started.stderr + home.log()
        pid = home.pid()
        before = _log_size(home)
        held = _flood(home.socket, port, 3 * HARD)
        try:
            assert wait_for(lambda: len(os.listdir(f"/proc/{pid}/fd")) >= SOFT - 1, 10)
            time.sleep(4)  # trio's loop: 40 tracebacks by now
            grown = (home.path / "colibrid.log").read_bytes()[before:].decode()
        finally:
            for sock in held:
                sock.close()
        assert "Traceback" not in grown
        assert len(grown) < 3000, grown
        assert grown.count("cannot accept SERVE connections: EMFILE") == 1, grown
        assert grown.count("accept returned EMFILE") <= 1, grown  # hypercorn's (trio's loop)
        ask = home.colibri("ask", "--max-tokens", "4", "What is the capital?", timeout=60)
        assert ask.returncode == 0 and ask.stdout.strip(), ask.stderr
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert health.status_code == 200
        assert wait_for(lambda: "accepting SERVE connections again" in home.log(), 10)
        assert f"open-file limit raised from {SOFT} to {HARD}" in home.log()
        with open(f"/proc/{pid}/limits") as limits:
            line = next(row for row in limits if row.startswith("Max open files"))
        assert line.split()[3:5] == [str(HARD), str(HARD)], line
    finally:
        home.close()
