"""`colibrid` command line: a table of subcommands, each a parser setup and a run function.

Expected failures (`ColibriError`) print one line `colibrid: error: <message>` and exit 1;
bad usage exits 2 (argparse); Ctrl-C exits 130 without a traceback; a reader that goes
away (`| head`) ends it quietly with 141 (pipes.py). Heavy imports (the
engine, numpy) happen inside the commands so `--help` stays instant.

`generate` is the one-shot path: load the model, run one prompt, stream the text.
Prompt modes: by default the text becomes one user message (plus `--system`) rendered
with the checkpoint's chat template; `--raw` encodes the text as it is with the
tokenizer's own special-token handling (`add_special_tokens=True`: whatever the
tokenizer.json post-processor adds, e.g. a BOS; GLM's `[gMASK]<sop>` only if its
post-processor says so); `--ids` sends token ids and needs no tokenizer with `--ids-out`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from colibrid import __version__, control
from colibrid.config import (
    PILOT_HELP,
    add_backend_flag,
    add_kernel_family_flag,
    add_speculate_flags,
    resolve_model,
)
from colibrid.errors import ColibriError, RequestError
from colibrid.panic_report import quiet_panic_reports
from colibrid.paths import Paths
from colibrid.pipes import quiet_when_reader_leaves

if TYPE_CHECKING:
    from colibrid.engine.sampling import SamplingParams
    from colibrid.engine.tokenizer import TextCodec


@dataclass(frozen=True)
class Command:
    """One subcommand: `configure` adds its arguments, `run` does it and returns the exit code."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---- generate -----------------------------------------------------------------------------
def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ids: {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"need one or more non-negative ids, got {text!r}")
    return ids


def _configure_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        metavar="NAME|DIR",
        help="an installed model's name (`colibri list`) or a checkpoint folder",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (default: read stdin)")
    src.add_argument(
        "--ids",
        type=_token_ids,
        metavar="1,2,3",
        help="prompt as token ids (implies --raw; no tokenizer needed with --ids-out)",
    )
    p.add_argument("--system", metavar="TEXT", help="system message for the chat template")
    p.add_argument("--raw", action="store_true", help="send the text as-is, no chat template")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off")
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument(
        "--stop",
        action="extend",
        nargs="+",
        default=[],
        metavar="STR",
        help="stop when this text appears (repeatable)",
    )
    p.add_argument(
        "--ids-out",
        action="store_true",
        help="print the generated token ids (comma-separated) instead of text",
    )
    add_kernel_family_flag(p)
    add_backend_flag(p)
    add_speculate_flags(p)
    p.add_argument("-v", "--verbose", action="store_true", help="more statistics on stderr")
    add_store_arguments(p)


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    """The expert-placement knobs (same names as `colibrid start` and config.toml keys)."""
    g = p.add_argument_group("expert placement (never changes tokens)")
    g.add_argument(
        "--ram-gb", type=float, metavar="N", help="RAM budget (default: 88%% of available memory)"
    )
    g.add_argument(
        "--cache",
        type=int,
        metavar="N",
        help="experts per layer in the RAM cache (overrides the budget)",
    )
    g.add_argument("--pin", choices=("off", "auto", "all"), help="pinned hot store")
    g.add_argument(
        "--pilot",
        choices=("on", "off", "auto"),
        help=PILOT_HELP,
    )
    g.add_argument("--io-threads", type=int, metavar="N", help="reader threads (0 = no pool)")
    g.add_argument("--direct", choices=("on", "off"), help="O_DIRECT / F_NOCACHE expert reads")
    g.add_argument("--profile", metavar="PATH", help="usage profile (.coli_usage) to learn from")
    p.add_argument(
        "--verify-weights",
        choices=("on", "off"),
        help="hold weight bytes to the manifest's digests: mapped ones at load, each "
        "streamed expert at its first read (config.toml key `verify_weights`, default on)",
    )


def store_options(args: argparse.Namespace):  # -> StoreOptions (lazy import)
    """StoreOptions from the flags; any placement flag selects the tiered store."""
    from colibrid.store.options import StoreOptions

    given = {
        k: getattr(args, k)
        for k in ("ram_gb", "cache", "pin", "pilot", "io_threads", "direct", "profile")
        if getattr(args, k) is not None
    }
    if "direct" in given:
        given["direct"] = given["direct"] == "on"
    verify = args.verify_weights != "off"  # a check, not a placement knob
    profiles = Paths.from_env(None).profiles  # PILOT remembers its measurements there
    try:
        return StoreOptions(
            mode="tiered" if given else "auto", verify=verify, profiles_dir=profiles, **given
        )
    except ValueError as exc:
        args.parser.error(str(exc))


def _read_stdin() -> str:
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:
        return sys.stdin.read()
    try:
        return stream.read().decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError("stdin is not valid UTF-8") from None


def _prompt_ids(
    args: argparse.Namespace, text: str | None, codec: TextCodec | None
) -> tuple[list[int], str]:
    if args.ids is not None:
        return args.ids, "ids"
    assert codec is not None and text is not None
    if args.raw:
        return codec.encode(text, add_special_tokens=True), "raw"
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages.append({"role": "user", "content": text})
    return codec.encode_chat(messages, add_generation_prompt=True), "chat"


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    """Validate everything that needs no file before touching the model (exit 2)."""
    from colibrid.engine.sampling import SamplingParams

    if (args.raw or args.ids is not None) and args.system is not None:
        args.parser.error("--system needs the chat template; it cannot go with --raw or --ids")
    if args.prompt is None and args.ids is None and (sys.stdin is None or sys.stdin.isatty()):
        args.parser.error("no prompt: give --prompt TEXT, --ids 1,2,3 or pipe text on stdin")
    try:
        return SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
        )
    except RequestError as exc:
        args.parser.error(str(exc))


def _text_side(
    args: argparse.Namespace, model: Path, params: SamplingParams
) -> tuple[TextCodec | None, frozenset[int]]:
    """The tokenizer (None for --ids with --ids-out: it may not exist) and the stop ids."""
    from colibrid.engine.tokenizer import TextCodec, has_tokenizer, load_stop_token_ids

    tokenizer_free = args.ids is not None and args.ids_out
    # Stop strings still use the tokenizer in that mode when there is one.
    if tokenizer_free and not (params.stop and has_tokenizer(model)):
        return None, load_stop_token_ids(model)
    codec = TextCodec.load(model)
    return codec, codec.stop_token_ids


def _run_generate(args: argparse.Namespace) -> int:
    from colibrid.backends.base import KernelFamily
    from colibrid.engine.generate import DoneEvent, generate
    from colibrid.engine.speculate import DEFAULT_MAX_DEPTH, SpecSettings
    from colibrid.engine.tokenizer import StreamingDetokenizer

    params = _sampling_params(args)
    text = args.prompt
    if text is None and args.ids is None:
        text = _read_stdin()
    model = resolve_model(Paths.from_env(None), args.model)
    from colibrid.engine.backend import make_ops

    family = KernelFamily(args.kernel_family)
    # one line, exit 1, when it cannot run
    ops = make_ops(args.backend or "auto", family, args.vram_gb)
    codec, stops = _text_side(args, model, params)
    prompt, mode = _prompt_ids(args, text, codec)

    from colibrid.engine.engine import Engine  # lazy: loads numpy, native kernels

    spec = SpecSettings(args.speculate or "auto", args.draft_max or DEFAULT_MAX_DEPTH)
    engine = Engine.load(
        model,
        family=family,
        ops=ops,
        store=store_options(args),
        mtp=spec.mode in ("mtp", "auto"),
    )
    if args.verbose:
        print(
            f"colibri: model {model}, family {args.kernel_family}, {mode} prompt of "
            f"{len(prompt)} tokens, {len(stops)} stop ids, context {engine.max_context}",
            file=sys.stderr,
        )
    detok = StreamingDetokenizer(codec) if codec else None
    out_ids: list[int] = []
    events = generate(
        engine, prompt, params, stop_token_ids=stops, detokenizer=detok, speculate=spec
    )
    for event in events:
        if isinstance(event, DoneEvent):
            break
        if args.ids_out:
            out_ids.append(event.token_id)
        elif event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    sys.stdout.write(",".join(map(str, out_ids)) + "\n" if args.ids_out else "\n")
    sys.stdout.flush()
    stats = event.stats.as_line(verbose=args.verbose)
    print(f"colibri: {stats}, finish={event.finish_reason}", file=sys.stderr)
    if event.spec is not None and (args.verbose or event.spec.verifies):
        print(f"colibri: {event.spec.describe()}", file=sys.stderr)
    if args.verbose:
        for line in engine.experts.statistics().lines():
            print(f"colibri: {line}", file=sys.stderr)
    engine.close()
    return 0


COMMANDS: tuple[Command, ...] = (
    Command("generate", "run one prompt and stream the answer", _configure_generate, _run_generate),
    Command("start", "start the daemon in the background", control.configure_start, control.start),
    Command("stop", "stop the daemon gracefully", control.configure_stop, control.stop),
    Command(
        "status", "is the daemon running, and with what", control.configure_status, control.status
    ),
    Command("run", "run the daemon in the foreground", control.configure_run, control.run),
)


# ---- entry point --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colibrid", description="colibri: Mixture-of-Experts inference, larger than RAM."
    )
    parser.add_argument("--version", action="version", version=f"colibrid {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.configure(sub)
        sub.set_defaults(run=command.run, parser=sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return quiet_when_reader_leaves(lambda: _parse_and_run(argv))  # `| head`: no traceback


def _parse_and_run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    # Rust reads this at a panic: a report of three lines in the daemon's log, not a
    # backtrace of ninety (which a crafted request could repeat at will)
    os.environ["RUST_BACKTRACE"] = "0"
    # a one-shot run: a native panic is its one error line, not the library's report too
    restore = quiet_panic_reports() if args.command == "generate" else None
    try:
        return _main(args)
    finally:
        if restore is not None:
            restore()


def _main(args: argparse.Namespace) -> int:
    try:
        return args.run(args)
    except ColibriError as exc:
        try:
            sys.stdout.flush()
            print(f"colibrid: error: {exc}", file=sys.stderr)
        except OSError:  # the detached daemon's stderr is the log, on the disk that filled
            pass
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
