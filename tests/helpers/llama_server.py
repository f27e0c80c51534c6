"""llama.cpp's own `llama-server`, started for a test and driven over its HTTP API.

CI builds llama.cpp's programs before pytest (`colibri llama-build`) but does not install
its Python binding (the optional extra colibri[peer]), so a test that asks llama.cpp
something about a GGUF asks a real `llama-server` process: one per GGUF, on a free
loopback port, in its own process group (a test that fails or is interrupted still ends
it), its output kept in a log file that a failure quotes. The questions are the ones the
binding answers in `colibri bench gguf`: ids of a text, pieces of ids, greedy decoding
from ids, and top-1 after each prefix.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest
from daemon_helpers import free_port

from colibrid.cluster.llama_build import LlamaBinaries, build, cached, missing_tools


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
        time.sleep(0.1)
    raise AssertionError(f"llama-server not healthy within {timeout_s} s:\n{proc.tail()}")


def llama_binaries() -> LlamaBinaries:
    """The `colibri llama-build` cache CI fills before pytest, else a build now (minutes),
    else a skip that says which tool is missing."""
    found = cached()
    if found is not None:
        return found
    reason = missing_tools()
    if reason:
        pytest.skip(f"llama.cpp's programs cannot be built here: {reason}")
    return build(say=lambda msg: print(f"llama.cpp: {msg}", file=sys.stderr))


class LlamaServer:
    """A `llama-server` serving one GGUF, one slot, no prompt cache: every request is
    computed from its own ids alone, so an answer cannot depend on the request before it."""

    def __init__(self, binaries: LlamaBinaries, gguf: Path, log: Path, n_ctx: int = 1024) -> None:
        self.gguf = gguf
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [str(binaries.llama_server), "-m", str(gguf), "-c", str(n_ctx), "-np", "1"]
        argv += ["--no-cache-prompt", "--cache-ram", "0", "--no-webui"]
        # attention as the binding computes it (its default): the CPU flash-attention path
        # rounds the queries to f16, enough to flip a near-tie of a random tiny model
        argv += ["--flash-attn", "off"]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        self.process = Process(argv, log)
        try:
            wait_healthy(self.process, self.url)
        except BaseException:
            self.process.stop()
            raise

    def close(self) -> None:
        self.process.stop()

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            raise AssertionError(f"llama-server {path}: {e.code} {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise AssertionError(f"llama-server {path}: {e}\n{self.process.tail()}") from None

    def tokenize(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        """llama.cpp's ids of each text, special tokens parsed; `add_bos` as the GGUF's
        add_bos_token asks."""
        body = {"add_special": add_bos, "parse_special": True}
        return [self.post("/tokenize", {**body, "content": t})["tokens"] for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        """The pieces of `ids`, joined as they are (nothing stripped)."""
        return self.post("/detokenize", {"tokens": list(ids)})["content"]

    def _greedy(self, ids: list[int], n: int) -> list[int]:
        # top_k 1 alone: the argmax of the logits, no penalty or bias before it; a token-id
        # prompt gets no BOS added
        body = {"prompt": ids, "n_predict": n, "samplers": ["top_k"], "top_k": 1}
        r = self.post("/completion", {**body, "cache_prompt": False, "return_tokens": True})
        return r["tokens"]

    def greedy(self, prompts: Sequence[list[int]], tokens: int) -> list[list[int]]:
        """`tokens` argmax steps from each prompt, each from the previous token. The server
        stops at an end-of-generation token (and returns it): decoding goes on from there
        in a new request, as an argmax loop does."""
        out = []
        for ids in prompts:
            got: list[int] = []
            while len(got) < tokens:
                step = self._greedy([*ids, *got], tokens - len(got))
                assert step, f"llama-server generated nothing after {len(ids) + len(got)} ids"
                got += step
            out.append(got)
        return out

    def teacher_forced(
        self, prompts: Sequence[list[int]], continuations: Sequence[list[int]]
    ) -> list[list[int]]:
        """llama.cpp's top-1 after each prefix of prompt + continuation."""
        return [
            [self._greedy([*ids, *cont[:i]], 1)[0] for i in range(len(cont))]
            for ids, cont in zip(prompts, continuations, strict=True)
        ]
