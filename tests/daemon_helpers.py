"""Running the real daemon and clients as subprocesses in a private $COLIBRI_HOME."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


class Home:
    """A $COLIBRI_HOME with its own config; every daemon started here is stopped on close."""

    def __init__(self, path: Path, model: Path, **settings: object) -> None:
        self.path = path
        self.model = model
        self.settings = settings
        path.mkdir(parents=True, exist_ok=True)
        lines = [f'default_model = "{model}"'] + [f"{k} = {_toml(v)}" for k, v in settings.items()]
        (path / "config.toml").write_text("\n".join(lines) + "\n")
        self.env = {**os.environ, "COLIBRI_HOME": str(path)}
        self.env.pop("COLIBRI_SOCKET", None)

    @property
    def socket(self) -> Path:
        return self.path / "run" / "colibrid.sock"

    @property
    def pidfile(self) -> Path:
        return self.path / "run" / "colibrid.pid"

    def colibrid(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "colibrid", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def colibri(
        self, *args: str, stdin: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "colibri_cli", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=stdin,
        )

    def popen_colibri(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "colibri_cli", *args],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    def start(self) -> None:
        result = self.colibrid("start")
        assert result.returncode == 0, result.stderr + self.log()
        assert "listening on" in result.stdout

    def pid(self) -> int | None:
        try:
            return int(self.pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def log(self) -> str:
        log = self.path / "colibrid.log"
        return log.read_text(errors="replace")[-3000:] if log.exists() else ""

    def close(self) -> None:
        """Stop the daemon; SIGKILL if it does not go (no daemon outlives a test)."""
        pid = self.pid()
        if pid is None:
            return
        try:
            self.colibrid("stop", "--timeout", "15", timeout=30)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.05)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False
    return True


def wait_for(predicate, timeout_s: float = 10.0, step_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


GLM_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think></think>{% endif %}"
)


def install_chat_tokenizer(model: Path) -> None:
    """Give a tiny oracle checkpoint folder a byte-level BPE tokenizer (vocabulary 320, within
    the tiny configs' 384) and a GLM-style chat template, so text clients can talk to it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = [
        "<|endoftext|>",
        "[gMASK]",
        "<sop>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<think>",
        "</think>",
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["What is the capital of France? Paris, café, 🙂 naïve."] * 50, trainer)
    assert tok.get_vocab_size() <= json.loads((model / "config.json").read_text())["vocab_size"]
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": GLM_TEMPLATE, "eos_token": "<|endoftext|>"})
    )


def start_http(path: Path, model: Path, **settings: object) -> Home:
    """A started daemon whose HTTP listener is on a free loopback port (`home.url`); the
    caller closes it."""
    port = free_port()
    home = Home(path, model, http=f"127.0.0.1:{port}", **{"shutdown_grace_s": 1.0, **settings})
    home.start()
    home.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return home


def serving_http(path: Path, model: Path, **settings: object) -> Iterator[Home]:
    """`start_http` for a module fixture (`yield from serving_http(...)`): the daemon is
    stopped when the fixture ends."""
    home = start_http(path, model, **settings)
    try:
        yield home
    finally:
        home.close()
