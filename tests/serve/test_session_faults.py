"""A bug inside the handling of one frame or one request costs that frame or request an
`ERROR <id|-> INTERNAL` line and a logged traceback, never the connection: the real SERVE
session on the deterministic test engine, with faults injected where the daemon's own
code could fail (a query, a SUBMIT's validation, a STOP, the encoding of an answer)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
from fake_engine import LineReader, open_daemon

from colibrid.serve import session
from colibrid.serve.requests import GenerateRequest


def boom(*args: object, **kw: object) -> None:
    raise RuntimeError("boom\nwith a second line")


async def ping(stream: trio.abc.Stream, reader: LineReader) -> None:
    await stream.send_all(b"PING\n")
    assert await reader.line() == "PONG"


async def answer(stream: trio.abc.Stream, reader: LineReader, rid: str) -> list[str]:
    """SUBMIT "a" for 3 tokens: the fake engine answers "bcd"."""
    await stream.send_all(f"SUBMIT {rid} 1 max_tokens=3\na\n".encode())
    lines = await reader.until(f"DONE {rid} ")
    assert lines[0].startswith(f"ACCEPT {rid} ")
    return [line for line in lines if not line.startswith(("ACCEPT", "DATA", "DONE"))]


@pytest.mark.trio
async def test_a_failing_query_is_internal_and_the_connection_lives(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_daemon(tmp_path) as daemon:
        daemon.state.status = boom  # type: ignore[method-assign]
        stream = await daemon.connect()
        reader = LineReader(stream)
        with caplog.at_level(logging.ERROR, logger="colibrid.session"):
            await stream.send_all(b"STATUS\n")
            assert await reader.line() == "ERROR - INTERNAL RuntimeError: boom with a second line"
        assert "handling STATUS failed" in caplog.text and "Traceback" in caplog.text
        await ping(stream, reader)
        assert await answer(stream, reader, "after") == ["b", "c", "d"]


@pytest.mark.trio
async def test_a_reply_body_that_is_not_json_is_internal(tmp_path: Path) -> None:
    async with open_daemon(tmp_path) as daemon:
        daemon.state.model_info = lambda: {"oops": object()}  # type: ignore[method-assign]
        stream = await daemon.connect()
        reader = LineReader(stream)
        await stream.send_all(b"MODEL\n")
        line = await reader.line()
        assert line.startswith("ERROR - INTERNAL TypeError: Object of type object")
        await ping(stream, reader)


@pytest.mark.trio
async def test_a_submit_that_fails_to_validate_is_internal_for_its_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_daemon(tmp_path) as daemon:
        stream = await daemon.connect()
        reader = LineReader(stream)
        with monkeypatch.context() as patch:
            patch.setattr(GenerateRequest, "from_submit", classmethod(boom))
            await stream.send_all(b"SUBMIT s1 1\na\n")
            assert (await reader.line()).startswith("ERROR s1 INTERNAL RuntimeError: boom")
        assert await answer(stream, reader, "s1") == ["b", "c", "d"]  # the id is free again


@pytest.mark.trio
async def test_a_failing_stop_never_names_the_running_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ERROR naming an id ends that request for the client; a STOP that fails must not
    claim that (the request still runs and ends by itself)."""
    async with open_daemon(tmp_path, layer_delay_s=0.01) as daemon:
        stream = await daemon.connect()
        reader = LineReader(stream)
        await stream.send_all(b"SUBMIT long 1 max_tokens=40\na\n")
        assert (await reader.line()).startswith("ACCEPT long ")
        monkeypatch.setattr(session.Handle, "stop", boom)
        await stream.send_all(b"STOP long\n")
        lines = await reader.until("ERROR ")
        assert lines[-1].startswith("ERROR - INTERNAL RuntimeError: boom")
        done = await reader.until("DONE long ")
        assert done[-1].startswith("DONE long STAT 40 ")


@pytest.mark.trio
async def test_an_answer_that_cannot_be_encoded_ends_only_that_request(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_daemon(tmp_path) as daemon:
        tiers = daemon.state.tiers
        calls = iter([boom])
        daemon.state.tiers = lambda: next(calls, tiers)()  # type: ignore[method-assign]
        stream = await daemon.connect()
        reader = LineReader(stream)
        with caplog.at_level(logging.ERROR, logger="colibrid.session"):
            await stream.send_all(b"SUBMIT e1 1 max_tokens=3\na\n")
            lines = await reader.until("ERROR ")
        assert lines[0].startswith("ACCEPT e1 ")
        assert lines[-1].startswith("ERROR e1 INTERNAL RuntimeError: boom")
        assert "request e1 failed while answering" in caplog.text
        await ping(stream, reader)
        assert await answer(stream, reader, "e2") == ["b", "c", "d"]
        with trio.fail_after(5):
            await daemon.state.scheduler.wait_idle()  # the failed request was let go


@pytest.mark.trio
async def test_deep_chat_json_is_a_bad_request_in_the_session(tmp_path: Path) -> None:
    payload = b"[" * 100_000 + b"]" * 100_000
    async with open_daemon(tmp_path) as daemon:
        stream = await daemon.connect()
        reader = LineReader(stream)
        await stream.send_all(b"SUBMIT deep %d chat=1\n" % len(payload) + payload + b"\n")
        line = await reader.line()
        assert line.startswith("ERROR deep BAD_REQUEST chat payload refused: JSON nested deeper")
        await ping(stream, reader)
        assert await answer(stream, reader, "deep") == ["b", "c", "d"]
