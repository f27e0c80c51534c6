"""`colibri ask [PROMPT...]`: one question to the daemon, the answer streamed to stdout.

The prompt is the arguments, then a blank line, then standard input when it is piped
(`cat notes.md | colibri ask "summarise this"`). Without `--raw` the text becomes one
user message (after `--system`) rendered by the daemon with the model's chat template.
While a long prompt is read, a progress line shows on stderr (a terminal only).
Ctrl-C cancels the request on the daemon and exits 130; a daemon error exits 1.

`--json-schema FILE`, `--grammar FILE`, `--regex RE` and `--format json` constrain the
answer: every token is masked to what the schema or grammar allows, so the output parses
(an answer cut by --max-tokens ends with finish=length, never looking complete). A bad
schema or grammar is refused with the reason before any token is generated.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence

from colibri_protocol.grammar import format_grammar
from colibri_protocol.messages import Accept, Data, Done, Submit

from colibri_cli.client import ClientError, ensure_daemon, model_name
from colibri_cli.options import add_answer_options, chat_sampling
from colibri_cli.render import ProgressLine, prefill_rate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri ask",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n")[2],  # what the constraint flags do
    )
    p.add_argument("prompt", nargs="*", help="prompt text (stdin is appended when piped)")
    add_answer_options(p, max_tokens=256, temperature=0.0)
    p.add_argument("--raw", action="store_true", help="send the text as-is, no chat template")
    p.add_argument(
        "--top-p", type=float, default=1.0, metavar="P", help="nucleus filter (default 1: off)"
    )
    p.add_argument(
        "--top-k", type=int, default=0, metavar="K", help="keep the K likeliest (default 0: off)"
    )
    p.add_argument(
        "--seed",
        type=int,
        metavar="S",
        help="sampling seed: same seed, same text (default: random)",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STR",
        help="stop when this text appears, not printed (repeatable)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='JSON lines: {"text": ...} per piece, then the statistics (numbers as numbers)',
    )
    p.add_argument(
        "--profile", metavar="NAME", help="usage profile this request counts into (default: active)"
    )
    p.add_argument("--model", metavar="NAME|DIR", help="model (started if no daemon runs)")
    p.add_argument(
        "--speculate",
        choices=("auto", "ngram", "mtp", "off"),
        help="speculative decoding for this request (lossless: the same answer, sooner when "
        "drafts are accepted; default: the daemon's `speculate`)",
    )
    p.add_argument("--draft-max", type=int, metavar="N", help="deepest speculative draft, 1-32")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema",
        metavar="FILE",
        help="answer with JSON that validates against the JSON schema in FILE",
    )
    shape.add_argument(
        "--grammar",
        metavar="FILE",
        help="answer in the Lark grammar in FILE (llguidance's dialect: rules, /regex/ "
        "terminals, %%json{schema} inside)",
    )
    shape.add_argument("--regex", metavar="RE", help="answer with text the regex matches whole")
    shape.add_argument(
        "--format", choices=("json",), help="answer with a JSON object (Ollama's format=json)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="statistics on stderr")
    return p


STDIN_NOTICE_S = 0.5  # a pipe with nothing to read this long gets a notice on a terminal


def read_prompt(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    parts = [" ".join(args.prompt)] if args.prompt else []
    if sys.stdin is not None and not sys.stdin.isatty():
        announce_stdin_wait(sys.stdin, sys.stderr)
        data = sys.stdin.buffer.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            parser.error("stdin is not valid UTF-8")
        if text:
            parts.append(text)
    if not parts:
        parser.error("no prompt: give it as arguments or pipe it on stdin")
    return "\n\n".join(parts)


def announce_stdin_wait(stdin, stderr) -> None:  # noqa: ANN001
    """`sleep 8 | colibri ask hi` used to wait without a word: when stdin has nothing to
    read for a moment and a person watches stderr, say what is awaited."""
    import select

    try:
        ready = select.select([stdin], [], [], STDIN_NOTICE_S)[0]
    except (OSError, ValueError):  # not selectable (a file object without fileno)
        return
    if not ready and stderr.isatty():
        print(
            "colibri ask: reading the rest of the prompt from stdin "
            "(it ends when the pipe closes)...",
            file=stderr,
            flush=True,
        )


def read_grammar(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict | None:
    """The grammar payload the constraint flags ask for (None: free text)."""
    if args.regex is not None:
        return {"regex": args.regex}
    if args.format == "json":
        return format_grammar("json")
    path = args.json_schema or args.grammar
    if path is None:
        return None
    flag = "--json-schema" if args.json_schema else "--grammar"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"{flag} {path}: {exc}")
    if args.grammar:
        return {"lark": text}
    try:
        return {"json_schema": json.loads(text)}
    except ValueError as exc:
        parser.error(f"--json-schema {path} is not JSON: {exc}")


def make_submit(
    args: argparse.Namespace, rid: str, text: str, grammar: dict | None = None
) -> Submit:
    common = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        profile=args.profile,
        model=model_name(args.model),
        speculate=args.speculate,
        draft_max=args.draft_max,
        keep_alive=args.keep_alive,
        grammar=grammar,
        **chat_sampling(args),
    )
    if args.raw:
        return Submit(rid, prompt=text, **common)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": text})
    return Submit(rid, messages=tuple(messages), **common)


def stats_line(done: Done) -> str:
    x = done.extras
    line = (
        f"colibri: {done.prompt_tokens} prompt ({x.get('cached', 0)} cached) + "
        f"{done.emitted} generated tokens, {prefill_rate(x)}, "
        f"decode {done.tok_s:.1f} tok/s, hit rate {done.hit_pct:.1f}%, "
        f"finish={done.finish}"
    )
    for extra in (speculation_line(x), grammar_line(x)):
        if extra is not None:
            line += f"\ncolibri: {extra}"
    return line


def grammar_line(x: dict[str, str]) -> str | None:
    """What the grammar's masks cost, from DONE's extras (None without a grammar)."""
    if "grammar" not in x:
        return None
    return f"grammar {x['grammar']}: {x.get('mask_us', '?')} µs a token for its masks"


def speculation_line(x: Mapping[str, object]) -> str | None:
    """What speculative decoding did (None when it was off), from DONE's extras (text) or
    STATUS's `speculation` (numbers): the same line either way."""
    mode = x.get("spec")
    if mode is None or mode == "off":
        return None
    if not int(str(x.get("verifies", 0))):
        return f"speculation {mode}: no draft was worth verifying"

    def two(key: str) -> str:
        return f"{float(str(x[key])):.2f}" if key in x else "?"

    gain = f", {two('gain')}x the plain decode rate" if "gain" in x else ""
    return (
        f"speculation {mode}: {x['verifies']} verifies of {two('depth')} drafts on average, "
        f"{x['accepted']} of {x['drafted']} drafts kept{gain} ({two('gain_predicted')}x predicted)"
    )


def _number(text: str) -> object:
    """A DONE extra as JSON: numbers as numbers (counts as integers), words as strings."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def done_json(done: Done) -> dict[str, object]:
    return {
        "done": True,
        "finish": done.finish,
        "prompt_tokens": done.prompt_tokens,
        "generated_tokens": done.emitted,
        "decode_tok_s": done.tok_s,
        "hit_pct": done.hit_pct,
        **{k: _number(v) for k, v in done.extras.items() if k != "finish"},
    }


def main(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.raw and args.system:
        parser.error("--system needs the chat template; it cannot go with --raw")
    grammar = read_grammar(args, parser)
    text = read_prompt(args, parser)
    out = sys.stdout
    try:
        client = ensure_daemon(args.model)
    except ClientError as exc:
        print(f"colibri ask: {exc}", file=sys.stderr)
        return 1
    rid = client.next_id()
    submit = make_submit(args, rid, text, grammar)
    status = ProgressLine(sys.stderr)
    try:
        for event in status.around(client.generate(submit)):
            if isinstance(event, Data):
                out.write(json.dumps({"text": event.text}) + "\n" if args.json else event.text)
                out.flush()
            elif isinstance(event, Done):
                out.write(json.dumps(done_json(event)) + "\n" if args.json else "\n")
                if args.verbose:
                    print(stats_line(event), file=sys.stderr)
            elif isinstance(event, Accept) and args.verbose:
                print(f"colibri: accepted, {event.prompt_tokens} prompt tokens", file=sys.stderr)
    except KeyboardInterrupt:
        status.clear()
        client.cancel(rid)
        out.write("\n")
        print("colibri: cancelled", file=sys.stderr)
        return 130
    except ClientError as exc:
        out.flush()
        print(f"colibri ask: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0
