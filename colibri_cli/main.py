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
    "kernels": ("colibrid.bench.kernels",
                "effective weight GB/s of each kernel path next to measured memory bandwidth"),
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
        print(f"colibri bench: unknown suite {suite!r} (choose from {', '.join(BENCH_SUITES)})",
              file=sys.stderr)
        return 2
    import importlib

    from colibrid.errors import ColibriError

    module = importlib.import_module(BENCH_SUITES[suite][0])
    try:
        return int(module.main(rest) or 0)
    except ColibriError as exc:
        print(f"colibri bench {suite}: error: {exc}", file=sys.stderr)
        return 1


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "bench": (_run_bench, "measure kernels (and later streaming, policies) against the machine"),
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
