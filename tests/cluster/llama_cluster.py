"""A real llama.cpp RPC cluster on loopback, for tests: `ggml-rpc-server` processes and a
`llama-server` in front (or alone, the single-process reference), each started in its own
process group and always torn down (SIGTERM, then SIGKILL), its output kept in a log file
that a failure quotes."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from helpers.llama_server import Process

# The README's question (`colibri ask "What is the capital of France?"`) with the settings
# `colibri ask` sends by default: greedy, its repetition penalty, its token limit.
QUESTION = "What is the capital of France?"
ASK_SETTINGS = {"temperature": 0, "repeat_penalty": 1.1, "repeat_last_n": 64, "max_tokens": 256}


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
