"""The README's commands exist as written: every `colibri`/`colibrid` command line of its
shell blocks names a real command whose `--help` succeeds and lists every flag the line
uses, and the same command refuses a flag it does not have. (A README that drifts from
the code fails here, not in front of a new user.)"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
NESTED = {"bench", "profile", "service", "completion"}  # colibri commands with sub-commands


def command_lines() -> list[list[str]]:
    """Token lists of every colibri/colibrid invocation in the README's ```sh blocks and
    its inline `code` spans (brackets of optional parts dropped)."""
    text = README.read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.S)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    blocks += [span for span in re.findall(r"`([^`\n]+)`", prose) if span.startswith("colibri")]
    out: list[list[str]] = []
    for block in blocks:
        block = block.replace("[", " ").replace("]", " ").replace("…", " ")
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            for part in re.split(r"&&|\|\||\||;", line):
                try:
                    tokens = shlex.split(part)
                except ValueError:
                    continue
                while (
                    tokens
                    and tokens[0] in ("cat", "echo", "sudo")
                    or (tokens and "=" in tokens[0] and not tokens[0].startswith("-"))
                ):
                    tokens = tokens[1:]
                if tokens and tokens[0] in ("colibri", "colibrid") and tokens not in out:
                    out.append(tokens)
    return out


def command_path(tokens: list[str]) -> list[str]:
    """The command and its sub-command words (what `--help` is asked of)."""
    words = [tokens[0]]
    rest = [t for t in tokens[1:]]
    if rest and not rest[0].startswith("-"):
        words.append(rest[0])
        if tokens[0] == "colibri" and rest[0] in NESTED and len(rest) > 1:
            if not rest[1].startswith("-"):
                words.append(rest[1])
    return words


@cache
def run(words: tuple[str, ...], extra: str) -> subprocess.CompletedProcess:
    module = "colibri_cli" if words[0] == "colibri" else "colibrid"
    return subprocess.run(
        [sys.executable, "-m", module, *words[1:], extra],
        capture_output=True,
        text=True,
        timeout=120,
    )


LINES = command_lines()


def test_the_readme_has_commands() -> None:
    assert len(LINES) >= 10


@pytest.mark.parametrize("tokens", LINES, ids=lambda t: " ".join(t)[:60])
def test_each_readme_command_parses(tokens: list[str]) -> None:
    words = tuple(command_path(tokens))
    helped = run(words, "--help")
    assert helped.returncode == 0, f"{' '.join(words)} --help: {helped.stderr[-300:]}"
    for flag in (t.split("=", 1)[0] for t in tokens if t.startswith("--")):
        assert flag in helped.stdout, f"{' '.join(words)} has no {flag} ({' '.join(tokens)})"
    refused = run(words, "--no-such-flag-anywhere")
    assert refused.returncode != 0, f"{' '.join(words)} accepted an unknown flag"
