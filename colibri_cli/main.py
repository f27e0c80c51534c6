"""`colibri`: the light client commands.

Each subcommand lives in its own module and is imported only when used, so `colibri`
starts fast and never imports numpy itself; heavy work (benchmarks, conversion) runs
in colibrid modules imported lazily by the subcommand.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from colibri_cli import __version__

BENCH_SUITES: dict[str, tuple[str, str]] = {
    "kernels": (
        "colibrid.bench.kernels",
        "effective weight GB/s of each kernel path next to measured memory bandwidth",
    ),
    "decode": (
        "colibrid.bench.decode",
        "resident prefill and decode tok/s vs the memory-bandwidth roofline",
    ),
    "stream": ("colibrid.bench.stream", "decode tok/s streaming experts vs the O_DIRECT roofline"),
    "batch": (
        "colibrid.bench.batch",
        "1, 2, 4, 8 requests decoded together: tok/s and expert bytes per token vs the disk",
    ),
    "spec": (
        "colibrid.bench.spec",
        "speculative decoding on and off: tok/s, accepted drafts, bytes per token",
    ),
    "replay": ("colibrid.bench.replay", "record a request once; replay it teacher-forced"),
    "policy": ("colibrid.bench.policy", "cache policies on a recorded trace vs Belady"),
    "peer": (
        "colibrid.bench.peer",
        "colibri and llama.cpp decoding the same model in the same run (optional extra)",
    ),
    "routing": (
        "colibrid.bench.routing",
        "per-layer expert skew and code-vs-prose difference on the built-in profiles",
    ),
}


def _run_bench(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: colibri bench SUITE [options]\n\nsuites:")
        for name, (_, summary) in BENCH_SUITES.items():
            print(f"  {name:<10} {summary}")
        print("\n`colibri bench SUITE --help` explains a suite's options.")
        return 0 if argv else 2
    suite, rest = argv[0], list(argv[1:])
    if suite not in BENCH_SUITES:
        print(
            f"colibri bench: unknown suite {suite!r} (choose from {', '.join(BENCH_SUITES)})",
            file=sys.stderr,
        )
        return 2
    import importlib

    from colibrid.errors import ColibriError

    module = importlib.import_module(BENCH_SUITES[suite][0])
    try:
        return int(module.main(rest) or 0)
    except ColibriError as exc:
        print(f"colibri bench {suite}: error: {exc}", file=sys.stderr)
        return 1


def _colibrid_command(module: str, name: str) -> Callable[[Sequence[str]], int]:
    """A subcommand implemented by ``module.main(argv)`` in colibrid, imported lazily."""

    def run(argv: Sequence[str]) -> int:
        import importlib

        from colibrid.errors import ColibriError

        try:
            return int(importlib.import_module(module).main(list(argv)) or 0)
        except ColibriError as exc:
            print(f"colibri {name}: error: {exc}", file=sys.stderr)
            return 1

    return run


def _lazy(module: str) -> Callable[[Sequence[str]], int]:
    """The `main(argv)` of colibri_cli.commands.<module>, imported only when run."""

    def run(argv: Sequence[str]) -> int:
        import importlib

        return int(importlib.import_module(f"colibri_cli.commands.{module}").main(argv) or 0)

    return run


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "ask": (_lazy("ask"), "ask the daemon one question; the answer streams to stdout"),
    "repl": (_lazy("repl"), "chat with the model interactively"),
    "ps": (_lazy("ps"), "what the daemon runs: model, profile, tiers, hit rate, queue"),
    "profile": (_lazy("profile"), "usage profiles: list | show | use | save | warm"),
    "bench": (
        _run_bench,
        "measure kernels, decode, streaming, policies and peers against the machine",
    ),
    "convert": (
        _colibrid_command("colibrid.convert.convert", "convert"),
        "convert a checkpoint (f32/bf16/FP8/NVFP4) into a colibri container",
    ),
    "pull": (
        _colibrid_command("colibrid.convert.demo", "pull"),
        "fetch and build the built-in demo model (`colibri pull demo`)",
    ),
    "inspect": (
        _colibrid_command("colibrid.convert.inspect", "inspect"),
        "describe a container: architecture, formats, expert size, totals",
    ),
    "config": (
        _colibrid_command("colibrid.config_reference", "config"),
        "every config.toml key: type, default, meaning (--toml: an example file)",
    ),
    "synth": (
        _colibrid_command("colibrid.convert.synth", "synth"),
        "write a synthetic container with real per-layer shapes for benchmarks",
    ),
}


def _usage() -> str:
    lines = ["usage: colibri COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "One-shot generation without a daemon: `colibrid generate --help`."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        print(f"colibri {__version__}")
        return 0
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"colibri: unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        return command[0](args[1:])
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
