"""protocol/SERVE.md's hand-typed session, executed: the typed lines are sent to a daemon
(the real SERVE session code on the deterministic test engine) and every answer must be of
the kind the document shows, for the same request, in the same order. A wrong payload byte
count in the document would answer BAD_FRAME here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fake_engine import LineReader, open_daemon

DOC = Path(__file__).resolve().parents[2] / "protocol" / "SERVE.md"
TYPED = re.compile(r"^(HELLO \d+|SUBMIT |CANCEL |STOP |PING$|QUIT$|STATUS$|[a-z]+$)")


def session() -> list[tuple[str, str]]:
    """The transcript as (who, line): 'client' for typed lines (and SUBMIT payloads, by
    their byte count), 'daemon' for answers (DATA payload lines folded into their DATA)."""
    text = DOC.read_text()
    block = text.split("## A session typed by hand", 1)[1].split("```", 2)[1]
    lines = block.splitlines()[2:]  # after the opening fence and the socat command
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if TYPED.match(line) and not line.startswith("HELLO 1 "):
            out.append(("client", line))
            words = line.split()
            if words[0] == "SUBMIT":
                payload, need = [], int(words[2])
                while sum(len(p.encode()) + 1 for p in payload) < need + 1:
                    payload.append(lines[i])
                    i += 1
                out.append(("client", "\n".join(payload)))
        elif line.startswith("DATA "):
            out.append(("daemon", line))
            i += 1  # its payload line
        else:
            out.append(("daemon", line))
    return out


def kind_of(line: str) -> str:
    """What an answer is about: its kind and id (and an ERROR's code)."""
    words = line.split()
    if words[0] == "ERROR":
        return " ".join(words[:3])
    return " ".join(words[:2]) if len(words) > 1 and words[0] != "HELLO" else words[0]


def test_the_document_counts_its_payload_bytes() -> None:
    steps = session()
    for k, (who, line) in enumerate(steps):
        if who == "client" and line.startswith("SUBMIT"):
            payload = steps[k + 1][1]
            assert len(payload.encode()) == int(line.split()[2]), line


@pytest.mark.trio
async def test_the_typed_session_gets_the_answers_shown(tmp_path: Path) -> None:
    """Slow enough (a delay a layer) that the typed CANCEL finds its request running."""
    steps = session()
    want = [kind_of(ln) for who, ln in steps if who == "daemon" and not ln.startswith("DATA")]
    got: list[str] = []
    async with open_daemon(tmp_path, layer_delay_s=0.02) as daemon:
        stream = await daemon.connect()
        reader = LineReader(stream)
        for who, line in steps:
            if who == "client":
                await stream.send_all(line.encode() + b"\n")
            elif not line.startswith("DATA"):  # how many pieces: the model's business
                answer = await reader.line()
                while answer.startswith("DATA "):
                    await reader.line()  # its payload
                    answer = await reader.line()
                got.append(kind_of(answer))
    assert got == want
