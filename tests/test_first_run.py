"""What a newcomer meets when starting out, each once a surprise:

- the native kernels are compiled once per version, which takes a while, and used to
  pass in silence (the daemon's stderr is its log). The first `colibri ask` says so on
  stderr, through `colibri ask` -> `colibrid start` -> the daemon's readiness pipe, while
  stdout carries the answer alone; a later run says nothing;
- `colibrid start --http` on a port another program holds ended in "Exceptions from Trio
  nursery" (and sixty lines of traceback in the foreground), after loading the model: it
  is one line naming the address now, before the model loads.
"""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
from daemon_helpers import Home, free_port

NOTE = "compiling the native kernels for this machine"


def test_the_first_native_build_says_what_it_does(chat_model: Path, tmp_path: Path) -> None:
    home = Home(tmp_path / "home", chat_model)
    home.env["COLIBRI_NATIVE_DIR"] = str(tmp_path / "native")  # nothing built yet
    try:
        first = home.colibri("ask", "--max-tokens", "3", "--temperature", "0", "hi", timeout=600)
        assert first.returncode == 0, first.stderr + home.log()
        notes = [line for line in first.stderr.splitlines() if NOTE in line]
        assert notes == [f"colibrid: {NOTE} (once per version of colibri)"], first.stderr
        assert first.stderr.index(NOTE) < first.stderr.index("listening on")  # before the wait
        assert NOTE not in first.stdout and first.stdout.strip()
        assert NOTE in home.log()  # the daemon's own line, in its log
        again = home.colibrid(
            "generate", "--model", str(chat_model), "--ids", "1,2", "--ids-out",
            "--max-tokens", "2",
        )  # fmt: skip
        assert again.returncode == 0 and NOTE not in again.stderr, again.stderr
    finally:
        home.close()


def test_a_taken_http_port_is_one_line_before_the_model_loads(
    chat_model: Path, tmp_path: Path
) -> None:
    home = Home(tmp_path / "home", chat_model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv in (("start", "--http", f"127.0.0.1:{port}"), ("run", "--http", str(port))):
            done = home.colibrid(*argv)
            assert done.returncode == 1 and done.stdout == "", done.stderr
            assert done.stderr == (
                f"colibrid: error: cannot listen on 127.0.0.1:{port} for the HTTP API: "
                "Address already in use (another program listens there: pick another port "
                "with --http or config.toml key `http`)\n"
            )
        assert "loading" not in home.log()  # refused before the model
        assert home.colibrid("status").returncode == 3  # nothing left running
    try:  # the lock and pidfile went with it: a free port starts and answers
        port = free_port()
        started = home.colibrid("start", "--http", f"127.0.0.1:{port}")
        assert started.returncode == 0, started.stderr + home.log()
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()["status"] == "ok"
    finally:
        home.close()
