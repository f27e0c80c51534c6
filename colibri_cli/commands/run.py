"""`colibri run NAME [PROMPT...]`: load the installed model NAME in the daemon (starting
the daemon when none runs; loading NAME in place of another model when the daemon is
idle), then chat with it in the REPL on a terminal, or print one answer when a prompt is
given or standard input is piped (`echo hi | colibri run demo`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from colibri_protocol.codec import encode_line

from colibri_cli.client import ClientError, ensure_daemon
from colibri_cli.options import PENALTY_FLAGS, add_answer_options


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri run", description=__doc__)
    p.add_argument("name", metavar="NAME", help="installed model (`colibri list`)")
    p.add_argument("prompt", nargs="*", help="one question (else the REPL on a terminal)")
    # unset unless given: ask's defaults in a pipe, repl's on a terminal
    add_answer_options(p, max_tokens=None, temperature=None)
    return p


def load(name: str) -> None:
    """Have the daemon serve `name` (it loads it now if it can; MODEL_BUSY otherwise)."""
    with ensure_daemon(name) as client:
        if sys.stderr.isatty():
            print(f"colibri: loading {name}...", file=sys.stderr, flush=True)
        client.sock.settimeout(None)  # a 400 GB model takes its time to map
        client.call(encode_line("LOAD", name), want=("OK",))


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        load(args.name)
    except ClientError as exc:
        print(f"colibri run: {exc}", file=sys.stderr)
        return 1
    options = ["--model", args.name]
    for flag, value in (
        ("--system", args.system),
        ("--max-tokens", args.max_tokens),
        ("--temperature", args.temperature),
        ("--keep-alive", args.keep_alive),
        *((flag, getattr(args, name)) for flag, name in PENALTY_FLAGS.items()),
    ):
        if value is not None:
            options += [flag, str(value)]
    if args.prompt or not sys.stdin.isatty():
        from colibri_cli.commands import ask

        return ask.main([*options, "--", *args.prompt])
    from colibri_cli.commands import repl

    return repl.main(options)
