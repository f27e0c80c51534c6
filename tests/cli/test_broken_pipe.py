"""A reader that goes away (`colibri ps | head -3`) ends every command quietly: no
BrokenPipeError traceback, nothing on stderr, exit 141 (colibrid/pipes.py), on both entry
points, and the daemon serves the next request as before.

The pipe's read end is closed before the command starts, so every write fails: the same
failure `| head` causes, without racing `head` for the pipe's buffer (a short output fits
in it, which is why `colibri ps | head -3` failed only now and then)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_helpers import Home

READER_GONE = 141


@pytest.fixture(scope="module")
def home(chat_model: Path, tmp_path_factory) -> Home:
    h = Home(tmp_path_factory.mktemp("pipe"), chat_model)
    h.start()
    yield h
    h.close()


def into_closed_pipe(home: Home, *argv: str) -> subprocess.CompletedProcess:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left before the first byte
    try:
        return subprocess.run(
            [sys.executable, *argv],
            env=home.env,
            stdin=subprocess.DEVNULL,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "argv",
    [
        ("ask", "--max-tokens", "6", "What is the capital of France?"),
        ("ps",),
        ("ps", "--json"),
        ("list",),
        ("config", "--toml"),
        ("completion", "bash"),
        ("--help",),
    ],
    ids=lambda argv: " ".join(argv),
)
def test_colibri_commands_end_quietly(home: Home, argv: tuple[str, ...]) -> None:
    done = into_closed_pipe(home, "-m", "colibri_cli", *argv)
    assert (done.returncode, done.stderr) == (READER_GONE, "")


@pytest.mark.parametrize("argv", [("status",), ("status", "--json")], ids=" ".join)
def test_colibrid_commands_end_quietly(home: Home, argv: tuple[str, ...]) -> None:
    # `status` printed inside its socket's error handler: the broken pipe became
    # "cannot reach the daemon", though the daemon had answered
    done = into_closed_pipe(home, "-m", "colibrid", *argv)
    assert (done.returncode, done.stderr) == (READER_GONE, "")


def test_the_daemon_answers_after_a_reader_left_mid_answer(home: Home) -> None:
    prompt = ("ask", "--max-tokens", "12", "--temperature", "0", "Paris, café")
    before = home.colibri(*prompt)
    cut = into_closed_pipe(home, "-m", "colibri_cli", *prompt)
    after = home.colibri(*prompt)
    assert cut.returncode == READER_GONE
    assert before.returncode == after.returncode == 0, before.stderr + after.stderr
    assert after.stdout == before.stdout


def test_a_real_head_in_a_shell_pipeline(home: Home) -> None:
    """The issue's own command line: no traceback whichever side wins the race, and with
    pipefail the status is 0 (head) or 141 (colibri), never a Python error's 1 or 120."""
    script = (
        "set -o pipefail; "
        f"{sys.executable} -m colibri_cli ask --max-tokens 40 'Tell me about Paris' | head -c 3"
    )
    done = subprocess.run(
        ["bash", "-c", script],
        env=home.env,
        capture_output=True,
        text=True,
        errors="replace",  # head may cut a character in two
        timeout=120,
    )
    assert done.returncode in (0, READER_GONE) and "Traceback" not in done.stderr, done.stderr
