"""A blocking SERVE client on the shared codec (no numpy, no colibrid imports).

`connect` finds the daemon's socket the way the daemon does (`colibri_protocol.home`);
`ensure_daemon` starts one with `colibrid start` when none answers, and says so on
stderr. Responses are read into a queue so replies to several in-flight requests can be
taken in any order; unknown line kinds are ignored, as the protocol asks of clients.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from colibri_protocol import home
from colibri_protocol.codec import FrameDecoder, encode_line, response_payload_length
from colibri_protocol.errors import ProtocolError
from colibri_protocol.messages import (
    Accept,
    Data,
    Done,
    ErrorReply,
    Line,
    Logprobs,
    Progress,
    Reply,
    Response,
    Submit,
    encode_submit,
    parse_response,
)


class ClientError(Exception):
    """A failure to show the user as one line; `code` is the daemon's error code if any."""

    def __init__(self, message: str, code: str = "CLIENT") -> None:
        super().__init__(message)
        self.code = code


class NotRunning(ClientError):
    pass


class ConnectionLost(ClientError):
    """The daemon went away mid-conversation (stopped, restarted, crashed)."""


class Client:
    _ids = itertools.count(1)

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._decoder = FrameDecoder(response_payload_length)
        self._queue: deque[Response] = deque()

    @classmethod
    def connect(cls, path: Path | None = None, *, timeout_s: float | None = None) -> Client:
        path = path or home.socket_path()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise NotRunning(f"no daemon answers on {path} ({exc.strerror})") from None
        sock.settimeout(timeout_s)
        return cls(sock)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise ConnectionLost(f"lost the daemon: {exc}") from None

    def next_id(self) -> str:
        return f"c{os.getpid()}-{next(self._ids)}"

    def responses(self) -> Iterator[Response]:
        """Every response as it arrives (blocking)."""
        while True:
            while self._queue:
                yield self._queue.popleft()
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                raise ClientError("the daemon did not answer in time") from None
            except OSError as exc:
                raise ConnectionLost(f"lost the daemon: {exc}") from None
            if not data:
                raise ConnectionLost("the daemon closed the connection")
            for item in self._decoder.feed(data):
                if isinstance(item, ProtocolError):
                    raise ClientError(f"garbled reply from the daemon: {item.message}")
                self._queue.append(parse_response(item))

    def call(self, line: bytes, *, want: tuple[str, ...]) -> Any:
        """Send one daemon verb; the first reply of a kind in `want` (or its ERROR)."""
        self.send(line)
        for response in self.responses():
            if isinstance(response, ErrorReply) and response.id == "-":
                raise ClientError(f"{response.code}: {response.message}", response.code)
            if isinstance(response, Reply) and response.kind in want:
                return response.body
            if isinstance(response, Line) and response.kind in want:
                return response.args
        raise AssertionError("unreachable")

    def query(self, kind: str) -> Any:
        return self.call(encode_line(kind), want=(kind,))

    def generate(self, submit: Submit) -> Iterator[Accept | Progress | Data | Logprobs | Done]:
        """Send `submit` and yield its ACCEPT, PROGRESS, DATA, LOGPROBS (when asked) and
        DONE; an ERROR raises ClientError."""
        self.send(encode_submit(submit))
        yield from self.follow(submit.id)

    def follow(self, rid: str) -> Iterator[Accept | Progress | Data | Logprobs | Done]:
        for response in self.responses():
            if (
                isinstance(response, (Accept, Progress, Data, Logprobs, Done))
                and response.id == rid
            ):
                yield response
                if isinstance(response, Done):
                    return
            elif isinstance(response, ErrorReply) and response.id == rid:
                raise ClientError(f"{response.code}: {response.message}", response.code)

    def cancel(self, rid: str, *, timeout_s: float = 10.0) -> None:
        """Cancel `rid` and wait for its end, so the engine is known to be free."""
        self.send(encode_line("CANCEL", rid))
        self.sock.settimeout(timeout_s)
        try:
            for _ in self.follow(rid):
                pass
        except (ClientError, TimeoutError):
            pass


def daemon_status(timeout_s: float = 10.0) -> dict[str, Any] | None:
    """The daemon's STATUS, or None when no daemon runs (none is started for it)."""
    try:
        with Client.connect(timeout_s=timeout_s) as client:
            status = client.query("STATUS")
    except NotRunning:
        return None
    return status if isinstance(status, dict) else None


def start_daemon(model: str | None, stderr: TextIO) -> None:
    """Run `colibrid start` (the configured default model unless `model`). Another client
    starting one at the same moment is no failure: `colibrid start` waits for the daemon
    that is starting and says it is already running, and that one answers."""
    what = f"model {model}" if model else "the configured default model"
    print(f"colibri: no daemon running; starting one with {what}", file=stderr)
    cmd = [sys.executable, "-m", "colibrid", "start"] + (["--model", model] if model else [])
    # start's notes (the first run's native build) are shown as they come; its error line
    # is kept for the message below
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        errors = []
        for line in proc.stderr:
            if line.startswith("colibrid: error: "):
                errors.append(line.removeprefix("colibrid: error: ").strip())
            else:
                print(line.rstrip("\n"), file=stderr, flush=True)
        out = proc.stdout.read()
    if proc.returncode != 0:
        message = "; ".join(errors) or f"colibrid start exited with {proc.returncode}"
        if "already running" in message:
            print("colibri: another client started it; using that one", file=stderr)
            return
        raise ClientError(f"could not start the daemon: {message}")
    print(out.strip(), file=stderr)


def ensure_demo(model: str | None, stderr: TextIO) -> None:
    """With no model named or configured, pull the built-in demo model first if missing
    (a subprocess, so this client never imports numpy). ``COLIBRI_NO_PULL=1`` opts out
    (offline machines, tests): the daemon then says how to get a model."""
    if model not in (None, "demo") or os.environ.get("COLIBRI_NO_PULL"):
        return
    root = home.colibri_home()
    config = root / "config.toml"
    try:
        text = config.read_text(encoding="utf-8") if config.is_file() else ""
    except OSError:
        text = ""
    if model is None and any(
        line.strip().startswith("default_model") for line in text.splitlines()
    ):
        return
    if (root / "models" / "demo" / "manifest.json").is_file():
        return
    print(
        "colibri: no model configured; pulling the demo model (SmolLM2-135M-Instruct "
        "upcycled to a 16-expert MoE, ~93 MB download) — once",
        file=stderr,
    )
    cmd = [sys.executable, "-m", "colibri_cli", "pull", "demo"]
    try:
        stderr.fileno()
        result = subprocess.run(cmd, stdout=stderr, stderr=stderr)
    except (AttributeError, OSError, ValueError):  # not a real file: relay the output
        result = subprocess.run(cmd, capture_output=True, text=True)
        stderr.write(result.stdout + result.stderr)
    if result.returncode != 0:
        raise ClientError(
            "could not pull the demo model (see above); "
            "`colibri pull demo --from FILE.gguf` works offline"
        )


def is_remote(model: str | None) -> bool:
    """Whether `model` names a remote model (`colibri pull URL`: models/NAME/remote.json):
    the daemon answers it from its endpoint beside its own local model."""
    return bool(model) and (home.colibri_home() / "models" / str(model) / "remote.json").is_file()


def ensure_daemon(model: str | None = None, *, stderr: TextIO = sys.stderr) -> Client:
    try:
        return Client.connect()
    except NotRunning:
        local = None if is_remote(model) else model  # a remote model loads nothing here
        ensure_demo(local, stderr)
        start_daemon(local, stderr)
    return Client.connect()


def model_name(model: str | None) -> str | None:
    """What a request names: a directory's base name, or the NAME itself."""
    return Path(model).name if model else None
