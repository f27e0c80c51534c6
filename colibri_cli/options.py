"""The options every command that asks for an answer shares (`ask`, `repl`, `run`), defined
once so their names, types and help read the same everywhere."""

from __future__ import annotations

import argparse

from colibri_protocol.messages import seconds


def duration(text: str) -> float:
    """--keep-alive's value: seconds, or 30s, 5m, 1h."""
    try:
        return seconds(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration (seconds, or like 30s, 5m, 1h)"
        ) from None


def add_answer_options(
    p: argparse.ArgumentParser, *, max_tokens: int | None, temperature: float | None
) -> None:
    """--system, --max-tokens, --temperature and --keep-alive; a default of None leaves the
    value unset (the command that receives it decides)."""
    p.add_argument("--system", metavar="TEXT", help="system message (default: none)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        metavar="N",
        help="tokens at most per answer"
        + (
            f" (default {max_tokens})"
            if max_tokens is not None
            else " (default 256 for one answer, 512 in the REPL)"
        ),
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=temperature,
        metavar="T",
        help="0 = greedy, the same answer every time (default 0)",
    )
    p.add_argument(
        "--keep-alive",
        type=duration,
        metavar="DURATION",
        help="how long the model stays loaded once the daemon is idle after an answer: "
        "30s, 5m, 1h; 0 unloads it at once, a negative value keeps it (default: the "
        "daemon's keep_alive)",
    )
