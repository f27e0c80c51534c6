"""Hostile and broken SERVE frames at the real daemon, over its socket, and its shutdown.

Each malformed frame costs exactly one `ERROR` line and the connection reads on (only
`TOO_LARGE` closes it, as SERVE.md says); a chat payload nested 100,000 brackets deep is a
`BAD_REQUEST`, not a dead connection handler; after all of it a request on the same
connection answers what a fresh connection answers. On SIGTERM a queued request ends
`SHUTTING_DOWN` at once, a running one gets `shutdown_grace_s` and then `SHUTTING_DOWN`
too, and the daemon exits soon after; a client's own `CANCEL` is still `CANCELLED`.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from colibri_protocol.codec import Frame, FrameDecoder, response_payload_length
from daemon_helpers import Home, alive, wait_for

PROMPT = b"What is the capital of France?"


class Wire:
    """A raw connection: bytes out, the daemon's frames in (DATA payloads decoded)."""

    def __init__(self, path: Path, timeout_s: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.sock.settimeout(timeout_s)
        self.decoder = FrameDecoder(response_payload_length)
        self.pending: list[Frame] = []

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self) -> Frame:
        while not self.pending:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("the daemon closed the connection")
            for item in self.decoder.feed(data):
                assert isinstance(item, Frame), f"garbled reply: {item}"
                self.pending.append(item)
        return self.pending.pop(0)

    def until(self, last: Callable[[Frame], bool]) -> list[Frame]:
        """Frames up to and including the first for which `last` holds."""
        out = [self.frame()]
        while not last(out[-1]):
            out.append(self.frame())
        return out

    def ping(self) -> list[Frame]:
        """PING, and every frame before its PONG (so: what the previous frames caused)."""
        self.send(b"PING\n")
        return self.until(lambda f: f.kind == "PONG")[:-1]

    def answer(self, rid: str, *options: str) -> str:
        """SUBMIT `PROMPT` greedily for 8 tokens; the text of its DATA (DONE required)."""
        opts = " ".join(("max_tokens=8", "temperature=0", *options))
        self.send(f"SUBMIT {rid} {len(PROMPT)} {opts}\n".encode() + PROMPT + b"\n")
        frames = self.until(lambda f: f.kind in ("DONE", "ERROR") and f.args[0] == rid)
        assert frames[-1].kind == "DONE", frames[-1]
        return "".join((f.payload or b"").decode() for f in frames if f.kind == "DATA")


def errors(frames: list[Frame]) -> list[tuple[str, str]]:
    return [(f.args[0], f.args[1]) for f in frames if f.kind == "ERROR"]


def message(frame: Frame) -> str:
    return " ".join(frame.args[2:])


@pytest.fixture(scope="module")
def home(chat_model: Path, tmp_path_factory) -> Home:
    h = Home(tmp_path_factory.mktemp("frames"), chat_model, debug_layer_delay_s=0.01)
    h.start()
    yield h
    h.close()


@pytest.fixture(scope="module")
def fresh_answer(home: Home) -> str:
    wire = Wire(home.socket)
    try:
        return wire.answer("ref")
    finally:
        wire.close()


def test_100k_nested_chat_payload_is_a_bad_request_and_the_connection_lives(
    home: Home, fresh_answer: str
) -> None:
    payload = b"[" * 100_000 + b"]" * 100_000
    wire = Wire(home.socket)
    try:
        wire.send(b"SUBMIT deep %d chat=1\n" % len(payload) + payload + b"\n")
        (error,) = wire.until(lambda f: f.kind == "ERROR")
        assert error.args[:2] == ("deep", "BAD_REQUEST")
        assert "nested deeper than 64" in message(error)
        assert wire.ping() == []
        assert wire.answer("deep") == fresh_answer  # the same id, free again
    finally:
        wire.close()
    assert "Traceback" not in home.log()


# (frame bytes, the one ERROR it must cause: (id, code))
BAD_FRAMES: list[tuple[bytes, tuple[str, str]]] = [
    (b"FROBNICATE\n", ("-", "UNKNOWN_VERB")),
    (b"123 abc\n", ("-", "BAD_FRAME")),
    (b"\xff\xfe PING\n", ("-", "BAD_FRAME")),  # not UTF-8
    (b"A" * 70_000 + b"\n", ("-", "LINE_TOO_LONG")),
    (b"SUBMIT\n", ("-", "BAD_FRAME")),
    (b"SUBMIT a\n", ("a", "BAD_FRAME")),
    (b"SUBMIT a xyz\n", ("a", "BAD_FRAME")),  # bad counts: no payload follows
    (b"SUBMIT a -5\n", ("a", "BAD_FRAME")),
    (b"SUBMIT a 1 2 3\n", ("a", "BAD_FRAME")),
    (b"SUBMIT a 99999999999\n", ("a", "BAD_FRAME")),  # eleven digits
    (b"SUBMIT a 2\nabc\n", ("a", "BAD_FRAME")),  # payload not followed by LF: resync
    (b"SUBMIT bad/id 1\nx\n", ("-", "BAD_FRAME")),
    (b"SUBMIT " + b"i" * 64 + b" 1\nx\n", ("-", "BAD_FRAME")),  # id too long
    (b"SUBMIT a 3\n\xff\xfe\xfd\n", ("a", "BAD_REQUEST")),  # payload not UTF-8
    (b"SUBMIT a 1 foo=bar\nx\n", ("a", "BAD_REQUEST")),  # unknown option
    (b"SUBMIT a 1 max_tokens=-5\nx\n", ("a", "BAD_REQUEST")),
    (b"SUBMIT a 1 max_tokens=" + b"9" * 5000 + b"\nx\n", ("a", "BAD_REQUEST")),  # huge
    (b"SUBMIT a 1 temperature=nan\nx\n", ("a", "BAD_REQUEST")),
    (b"SUBMIT a 1 temperature=inf\nx\n", ("a", "BAD_REQUEST")),
    (b"SUBMIT a 1 top_p=0\nx\n", ("a", "BAD_REQUEST")),
    (b"SUBMIT a 1 conv=" + b"c" * 1000 + b"\nx\n", ("a", "BAD_REQUEST")),
    (b"SUBMIT a 1 stop=%ZZ%\nx\n", ("a", "BAD_REQUEST")),
    (b"SUBMIT a 1 stop=ab%\nx\n", ("a", "BAD_REQUEST")),
    (b"SUBMIT a 1 stop=\nx\n", ("a", "BAD_REQUEST")),
    (b"SUBMIT a 1 chat=2\nx\n", ("a", "BAD_REQUEST")),
    (b"SUBMIT a 2 chat=1\n[]\n", ("a", "BAD_REQUEST")),
    (b'SUBMIT a 20 chat=1\n[{"role": "user"}]  \n', ("a", "BAD_REQUEST")),
    (b"SUBMIT a 0 1 5 0 1 7\nxgrammar\n", ("a", "BAD_REQUEST")),  # upstream, not JSON
    (b"SUBMIT a 1 model=another-model\nx\n", ("a", "NOT_FOUND")),
    (b"STOP\n", ("-", "BAD_FRAME")),
    (b"STOP nothere\n", ("nothere", "NOT_FOUND")),
    (b"CANCEL bad/id\n", ("-", "BAD_FRAME")),
    (b"HELLO x\n", ("-", "BAD_FRAME")),
    (b"STATUS extra\n", ("-", "BAD_FRAME")),
    (b"PROFILE\n", ("-", "BAD_FRAME")),
    (b"PROFILE SHOW no-such-profile\n", ("-", "NOT_FOUND")),
]


def test_each_malformed_frame_costs_one_error_and_the_connection_lives(
    home: Home, fresh_answer: str
) -> None:
    wire = Wire(home.socket)
    try:
        for data, expected in BAD_FRAMES:
            wire.send(data)
            got = wire.ping()
            assert errors(got) == [expected], (data[:60], got)
            assert len(got) == 1, (data[:60], got)  # nothing else either (no ACCEPT)
        assert wire.answer("after") == fresh_answer
    finally:
        wire.close()
    assert "Traceback" not in home.log()


def test_duplicate_id_and_a_client_cancel(home: Home, fresh_answer: str) -> None:
    wire = Wire(home.socket)
    try:
        long = b"SUBMIT dup %d max_tokens=200\n" % len(PROMPT) + PROMPT + b"\n"
        wire.send(long + b"SUBMIT dup 1\nx\n")  # one write: `dup` is surely in flight
        first = wire.until(lambda f: f.kind == "ERROR")  # before or after dup's ACCEPT
        assert errors(first) == [("dup", "DUPLICATE_ID")]
        wire.send(b"CANCEL dup\n")
        end = wire.until(lambda f: f.kind in ("ERROR", "DONE") and f.args[0] == "dup")[-1]
        assert end.kind == "ERROR" and end.args[1] == "CANCELLED", end
        assert message(end).startswith("cancelled")
        assert wire.ping() == []
        assert wire.answer("dup") == fresh_answer
    finally:
        wire.close()


def test_too_large_closes_the_connection_and_only_that_one(home: Home, fresh_answer: str) -> None:
    other = Wire(home.socket)
    wire = Wire(home.socket)
    try:
        wire.send(b"SUBMIT big 99999999\n")
        (error,) = wire.until(lambda f: f.kind == "ERROR")
        assert error.args[:2] == ("big", "TOO_LARGE")
        with pytest.raises((EOFError, OSError)):  # EOF, reset or broken pipe: closed
            wire.ping()
        assert other.answer("fine") == fresh_answer
    finally:
        wire.close()
        other.close()


def test_sigterm_ends_queued_and_overdue_requests_with_shutting_down(
    chat_model: Path, tmp_path_factory
) -> None:
    grace = 1.5
    home = Home(
        tmp_path_factory.mktemp("term"),
        chat_model,
        shutdown_grace_s=grace,
        debug_layer_delay_s=0.05,  # 3 layers: ~0.15 s a token, 200 tokens ~30 s
        max_active=1,  # so the second request waits in the queue
    )
    home.start()
    wire = late = None
    try:
        pid = home.pid()
        wire = Wire(home.socket)
        submit = b"SUBMIT %s %d max_tokens=200\n" % (b"%s", len(PROMPT))
        wire.send(submit % b"run" + PROMPT + b"\n" + submit % b"queued" + PROMPT + b"\n")
        wire.until(lambda f: f.kind == "DATA" and f.args[0] == "run")  # decoding now
        t0 = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        frames = wire.until(lambda f: f.kind == "ERROR" and f.args[0] == "queued")
        assert errors(frames) == [("queued", "SHUTTING_DOWN")]
        assert time.monotonic() - t0 < grace  # at once, not after the grace
        late = Wire(home.socket)  # still listening during the grace: new work is refused
        late.send(b"SUBMIT new 1\nx\n")
        (refused,) = late.until(lambda f: f.kind == "ERROR")
        assert refused.args[:2] == ("new", "SHUTTING_DOWN")
        end = wire.until(lambda f: f.kind in ("ERROR", "DONE") and f.args[0] == "run")[-1]
        waited = time.monotonic() - t0
        assert end.kind == "ERROR" and end.args[1] == "SHUTTING_DOWN", end
        assert message(end).startswith("the daemon stopped after ")
        assert waited >= grace * 0.9, waited  # it was given the grace
        assert wait_for(lambda: not alive(pid), timeout_s=grace + 5.0), home.log()
        assert time.monotonic() - t0 < grace + 5.0
        assert not home.socket.exists()
        assert "Traceback" not in home.log()
    finally:
        for w in (wire, late):
            if w is not None:
                w.close()
        home.close()
