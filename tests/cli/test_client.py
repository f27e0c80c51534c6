"""The conformance vectors, client side: the daemon's lines of every transcript go through
the real client (over a socket pair); it must parse each, ignore unknown kinds, and
assemble exactly the answer text the vector names."""

from __future__ import annotations

import io
import socket

import pytest
from colibri_protocol.messages import Data, Done, ErrorReply
from colibri_protocol.vectors import Vector, all_vectors

from colibri_cli.client import Client, ClientError


@pytest.mark.parametrize("vector", all_vectors(), ids=lambda v: v.name)
def test_client_reads_vector(vector: Vector) -> None:
    ours, theirs = socket.socketpair()
    theirs.sendall(vector.server_bytes())
    theirs.close()
    client = Client(ours)
    texts: dict[str, str] = {}
    done: set[str] = set()
    try:
        for response in client.responses():
            if isinstance(response, Data):
                texts[response.id] = texts.get(response.id, "") + response.text
            elif isinstance(response, Done):
                done.add(response.id)
            elif isinstance(response, ErrorReply):
                assert response.code
    except ClientError as exc:
        assert "closed" in str(exc)
    for rid, text in vector.expect_text.items():
        assert texts.get(rid, "") == text and rid in done


def test_generate_raises_on_error_for_its_id() -> None:
    ours, theirs = socket.socketpair()
    theirs.sendall(b"ACCEPT other 1\nERROR x BUSY the queue is full\n")
    client = Client(ours)
    with pytest.raises(ClientError) as info:
        list(client.follow("x"))
    assert info.value.code == "BUSY"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_shows_on_a_terminal_only_and_erases_itself() -> None:
    from colibri_cli.render import ProgressLine, prefill_text

    term = _Terminal()
    line = ProgressLine(term)
    line.show(prefill_text(39, 78, 75.0))
    line.show(prefill_text(52, 78, 90.0))
    line.clear()
    line.clear()  # a second clear writes nothing
    assert term.getvalue() == (
        "\r\x1b[K(reading the prompt: 50%, 1m15s)\r\x1b[K(reading the prompt: 67%, 1m30s)\r\x1b[K"
    )
    piped = io.StringIO()
    quiet = ProgressLine(piped)
    quiet.show("anything")
    quiet.clear()
    assert piped.getvalue() == ""


def test_prefill_rate_says_when_the_prompt_was_all_cached() -> None:
    from colibri_cli.render import prefill_rate

    assert prefill_rate({"prefill_tok_s": "106.3"}) == "prefill 106.3 tok/s"
    assert prefill_rate({"prefill_tok_s": "0.0", "cached": "38"}) == "prompt fully cached"
    assert prefill_rate({}) == "prefill ? tok/s"
