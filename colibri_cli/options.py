"""The options every command that asks for an answer shares (`ask`, `repl`, `run`), defined
once so their names, types and help read the same everywhere."""

from __future__ import annotations

import argparse

from colibri_protocol.home import colibri_home, config_values
from colibri_protocol.messages import seconds

# The chat commands' repetition penalty when config.toml says nothing: Ollama's 1.1 over the
# last 64 tokens. Greedy decoding of a small model loops a paragraph without it (docs/
# sampling.md has the transcripts); SERVE and the HTTP APIs keep theirs off, as they define.
CHAT_REPEAT_PENALTY = 1.1
CHAT_REPEAT_LAST_N = 64


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
    add_penalty_options(p)
    p.add_argument(
        "--keep-alive",
        type=duration,
        metavar="DURATION",
        help="how long the model stays loaded once the daemon is idle after an answer: "
        "30s, 5m, 1h; 0 unloads it at once, a negative value keeps it (default: the "
        "daemon's keep_alive)",
    )


def add_penalty_options(p: argparse.ArgumentParser) -> None:
    """Repetition control and min-p (engine.penalties); unset flags take the chat defaults
    (`chat_sampling`)."""
    p.add_argument(
        "--repeat-penalty",
        type=float,
        metavar="R",
        help="divide the logit of a token seen in the last --repeat-last-n tokens by R "
        f"(1 = off; default config.toml chat_repeat_penalty, else {CHAT_REPEAT_PENALTY})",
    )
    p.add_argument(
        "--repeat-last-n",
        type=int,
        metavar="N",
        help="how far back --repeat-penalty looks, the prompt included (-1: the whole "
        f"context; default chat_repeat_last_n, else {CHAT_REPEAT_LAST_N})",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        metavar="F",
        help="lower a token's logit by F per time it was generated, -2..2 (default 0)",
    )
    p.add_argument(
        "--presence-penalty",
        type=float,
        metavar="P",
        help="lower a token's logit by P once it was generated, -2..2 (default 0)",
    )
    p.add_argument(
        "--min-p",
        type=float,
        metavar="M",
        help="sample only tokens at least M times as likely as the likeliest, 0..1 (default 0)",
    )


PENALTY_FLAGS = {
    "--repeat-penalty": "repeat_penalty",
    "--repeat-last-n": "repeat_last_n",
    "--frequency-penalty": "frequency_penalty",
    "--presence-penalty": "presence_penalty",
    "--min-p": "min_p",
}


def chat_sampling(args: argparse.Namespace) -> dict[str, float | int]:
    """The penalty fields of a chat command's SUBMIT: the flags given, else config.toml's
    chat_repeat_penalty / chat_repeat_last_n, else the built-in chat defaults. Ranges are
    the daemon's to check (one message for every client)."""
    config = config_values(colibri_home() / "config.toml")
    penalty = config.get("chat_repeat_penalty", CHAT_REPEAT_PENALTY)
    last_n = config.get("chat_repeat_last_n", CHAT_REPEAT_LAST_N)
    out: dict[str, float | int] = {
        "repeat_penalty": float(penalty) if isinstance(penalty, (int, float)) else 1.0,
        "repeat_last_n": last_n if isinstance(last_n, int) else CHAT_REPEAT_LAST_N,
    }
    for name in PENALTY_FLAGS.values():
        value = getattr(args, name, None)
        if value is not None:
            out[name] = value
    return out
