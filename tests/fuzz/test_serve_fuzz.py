"""Random and malformed frames thrown at the SERVE session (real session, scheduler and
engine host on the test engine): every one is answered or ignored, nothing is INTERNAL,
and the same connection and new ones keep working. The real daemon gets a burst too, in
tests/test_daemon.py."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
from fake_engine import LineReader, open_daemon  # noqa: E402

# SUBMIT has its own generator below: a random huge byte count there would be TOO_LARGE,
# the one error that (by design) closes the connection; test_too_large_closes checks it.
VERBS = [
    "STOP",
    "CANCEL",
    "HELLO",
    "STATUS",
    "MODEL",
    "TELEMETRY",
    "PROFILE",
    "PING",
    "QUIT_NOT",
    "DATA",
    "DONE",
    "stop",
    "X",
    "éé",
    "",
]
OPTIONS = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "chat",
    "conv",
    "profile",
    "model",
    "bogus",
]
VALUES = [
    "0",
    "1",
    "-1",
    "2",
    "0.5",
    "nan",
    "inf",
    "1e309",
    "abc",
    "%ZZ",
    "%0A",
    "",
    "99999999",
    "a/b",
    "x" * 70,
]


def random_frame(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.15:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 60))) + b"\n"
    if kind < 0.55:
        rid = rng.choice(["r1", "r2", "-", "bad/id", "x" * 70, str(rng.randint(0, 9))])
        payload = "".join(rng.choice('ab\n[]{}"é:,') for _ in range(rng.randint(0, 20)))
        data = payload.encode()
        count = len(data) + rng.choice([0, 0, 0, 1, -1, 5])
        opts = " ".join(
            f"{rng.choice(OPTIONS)}={rng.choice(VALUES)}" for _ in range(rng.randint(0, 4))
        )
        if rng.random() < 0.5:
            opts += " max_tokens=2"
        return f"SUBMIT {rid} {max(count, 0)} {opts}\n".encode() + data + b"\n"
    words = [rng.choice(VERBS)] + [
        rng.choice(VALUES + ["r1", "LIST", "USE", "SHOW"]) for _ in range(rng.randint(0, 3))
    ]
    return " ".join(words).encode("utf-8") + b"\n"


async def throw(tmp: Path, frames: list[bytes]) -> list[str]:
    async with open_daemon(tmp, max_queue=64) as daemon:
        conn = await daemon.connect()
        reader = LineReader(conn)
        seen: list[str] = []

        async def collect() -> None:
            try:
                while True:
                    seen.append(await reader.line(timeout_s=30))
            except EOFError:
                pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect)
            for frame in frames:
                await conn.send_all(frame)
            # the newlines end any short pending payload; the frames contain PINGs of their
            # own, so the end is a request whose answer comes after every earlier frame's
            await conn.send_all(b"\n" * 80 + b"SUBMIT fuzz-end 1 max_tokens=1\na\n")
            with trio.fail_after(60):
                while not any(line.startswith("DONE fuzz-end") for line in seen):
                    await trio.sleep(0.01)
            other = await daemon.connect()
            await other.send_all(b"SUBMIT ok 1 max_tokens=2\na\n")
            lines = await LineReader(other).until("DONE ok")
            assert lines[-1].startswith("DONE ok STAT 2")
            nursery.cancel_scope.cancel()
        return seen


def test_thousands_of_random_frames(tmp_path: Path) -> None:
    rng = random.Random(1234)
    frames = [random_frame(rng) for _ in range(3000)]
    seen = trio.run(throw, tmp_path, frames)
    assert not [line for line in seen if " INTERNAL " in line]
    errors = [line for line in seen if line.startswith("ERROR")]
    assert len(errors) > 1000  # malformed frames were answered, not dropped


def test_too_large_closes_the_connection_after_saying_so(tmp_path: Path) -> None:
    async def main() -> list[str]:
        async with open_daemon(tmp_path) as daemon:
            conn = await daemon.connect()
            reader = LineReader(conn)
            await conn.send_all(b"PING\nSUBMIT big 99999999\n")
            lines = [await reader.line(), await reader.line()]
            try:
                lines.append(await reader.line())
            except EOFError:
                lines.append("<closed>")
            return lines

    assert trio.run(main)[1:] == [
        "ERROR big TOO_LARGE SUBMIT byte count 99999999 exceeds the limit of 16777216",
        "<closed>",
    ]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=20))
def test_arbitrary_bytes_then_ping(chunks: list[bytes]) -> None:
    import tempfile

    frames = [c.replace(b"SUBMIT", b"SUBMlT") + b"\n" for c in chunks]  # no huge payloads
    with tempfile.TemporaryDirectory() as tmp:
        seen = trio.run(throw, Path(tmp), frames)
    assert not [line for line in seen if " INTERNAL " in line]
