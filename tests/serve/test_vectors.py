"""The conformance vectors (protocol/vectors), daemon side: the real SERVE session code
over an in-memory stream, on the deterministic test engine, must answer every `>` block
with exactly the `<` lines. The client side of the same files is tests/cli/test_client.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from colibri_protocol.vectors import Vector, all_vectors, matches
from fake_engine import LineReader, open_daemon

SERVER_VECTORS = [v for v in all_vectors() if not v.client_only]


@pytest.mark.trio
@pytest.mark.parametrize("vector", SERVER_VECTORS, ids=lambda v: v.name)
async def test_daemon_answers_vector(vector: Vector, tmp_path: Path) -> None:
    async with open_daemon(tmp_path) as daemon:
        stream = await daemon.connect()
        reader = LineReader(stream)
        for kind, text in vector.steps:
            if kind == "send":
                await stream.send_all(text.encode("utf-8") + b"\n")
            else:
                line = await reader.line()
                assert matches(text, line), f"{vector.name}: expected {text!r}, got {line!r}"


def test_matcher() -> None:
    assert matches("DONE a STAT 3 * ...", "DONE a STAT 3 1.0 x y")
    assert not matches("DONE a STAT 3 * ...", "DONE a STAT 4 1.0")
    assert matches("ERROR - BAD_FRAME SUBMIT needs ...", "ERROR - BAD_FRAME SUBMIT needs `x`")
    assert matches(" 4", " 4") and not matches("b", "c")
