"""A real llama.cpp RPC cluster on loopback, for tests: `ggml-rpc-server` processes and a
`llama-server` in front (or alone, the single-process reference), each started in its own
process group and always torn down (SIGTERM, then SIGKILL), its output kept in a log file
that a failure quotes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

# The README's question (`colibri ask "What is the capital of France?"`) with the settings
# `colibri ask` sends by default: greedy, its repetition penalty, its token limit.
QUESTION = "What is the capital of France?"
ASK_SETTINGS = {"temperature": 0, "repeat_penalty": 1.1, "repeat_last_n": 64, "max_tokens": 256}


class Process:
    """One started program; `stop` ends its whole process group."""

    def __init__(self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.log = log
        self._out = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._out.close()


def start(stack: ExitStack, argv: Sequence[str], log: Path, env=None) -> Process:
    """Start a program whose stop the stack owns."""
    p = Process(argv, log, env)
    stack.callback(p.stop)
    return p


def wait_listening(proc: Process, port: int, timeout_s: float = 60) -> None:
    """Until the program accepts TCP on loopback `port` (it must not exit meanwhile)."""
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise AssertionError(f"{proc.argv[0]} exited {proc.proc.returncode}:\n{proc.tail()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"{proc.argv[0]} did not listen on {port}:\n{proc.tail()}")


def wait_healthy(proc: Process, url: str, timeout_s: float = 300) -> None:
    """Until llama-server's /health says the model is loaded."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise AssertionError(f"llama-server exited {proc.proc.returncode}:\n{proc.tail()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise AssertionError(f"llama-server not healthy within {timeout_s} s:\n{proc.tail()}")


def chat(url: str, content: str = QUESTION, **settings: object) -> dict:
    """One OpenAI chat completion from llama-server, with `colibri ask`'s settings."""
    body = {"messages": [{"role": "user", "content": content}], **ASK_SETTINGS, **settings}
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())
