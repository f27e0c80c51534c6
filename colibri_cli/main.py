"""`colibri`: the light client commands.

Each subcommand lives in its own module and is imported only when used, so `colibri`
starts fast and never imports numpy itself; heavy work (benchmarks, conversion) runs
in colibrid modules imported lazily by the subcommand.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from colibri_cli import __version__


@dataclass(frozen=True)
class Command:
    """One `colibri` subcommand: the module whose `main(argv)` runs it and whose
    `build_parser()` describes it (for --help and shell completion), imported only when
    used. Modules of colibrid (heavy: numpy) report their errors as one line here."""

    module: str
    summary: str

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def run(self, name: str, argv: Sequence[str]) -> int:
        if not self.module.startswith("colibrid."):
            return int(self.load().main(list(argv)) or 0)
        from colibrid.errors import ColibriError

        try:
            return int(self.load().main(list(argv)) or 0)
        except ColibriError as exc:
            print(f"colibri {name}: error: {exc}", file=sys.stderr)
            return 1


def _client(module: str, summary: str) -> Command:
    return Command(f"colibri_cli.commands.{module}", summary)


BENCH_SUITES: dict[str, Command] = {
    "kernels": Command(
        "colibrid.bench.kernels",
        "effective weight GB/s of each kernel path next to measured memory bandwidth",
    ),
    "decode": Command(
        "colibrid.bench.decode",
        "resident prefill and decode tok/s vs the memory-bandwidth roofline",
    ),
    "stream": Command(
        "colibrid.bench.stream", "decode tok/s streaming experts vs the O_DIRECT roofline"
    ),
    "batch": Command(
        "colibrid.bench.batch",
        "1, 2, 4, 8 requests decoded together: tok/s and expert bytes per token vs the disk",
    ),
    "spec": Command(
        "colibrid.bench.spec",
        "speculative decoding on and off: tok/s, accepted drafts, bytes per token",
    ),
    "replay": Command("colibrid.bench.replay", "record a request once; replay it teacher-forced"),
    "policy": Command("colibrid.bench.policy", "cache policies on a recorded trace vs Belady"),
    "peer": Command(
        "colibrid.bench.peer",
        "colibri and llama.cpp decoding the same model in the same run (optional extra)",
    ),
    "gguf": Command(
        "colibrid.bench.gguf_agree",
        "greedy tokens of a `colibri export` GGUF in llama.cpp vs colibri (optional extra)",
    ),
    "routing": Command(
        "colibrid.bench.routing",
        "per-layer expert skew and code-vs-prose difference on the built-in profiles",
    ),
}


def _run_bench(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: colibri bench SUITE [options]\n\nsuites:")
        for name, suite in BENCH_SUITES.items():
            print(f"  {name:<10} {suite.summary}")
        print("\n`colibri bench SUITE --help` explains a suite's options.")
        return 0 if argv else 2
    name, rest = argv[0], list(argv[1:])
    suite = BENCH_SUITES.get(name)
    if suite is None:
        print(
            f"colibri bench: unknown suite {name!r} (choose from {', '.join(BENCH_SUITES)})",
            file=sys.stderr,
        )
        return 2
    return suite.run(f"bench {name}", rest)


BENCH_SUMMARY = "measure kernels, decode, streaming, batching, speculation, policies and peers"

COMMANDS: dict[str, Command] = {
    "ask": _client("ask", "ask the daemon one question; the answer streams to stdout"),
    "repl": _client("repl", "chat with the model interactively"),
    "run": _client("run", "load an installed model, then chat (or answer one prompt)"),
    "list": _client("list_models", "installed models: architecture, size, formats, loaded"),
    "pull": Command(
        "colibrid.convert.pull",
        "install a model: demo, a checkpoint folder (converted), a container, a .gguf",
    ),
    "stop": _client("stop", "unload the model (the daemon stays; a request reloads one)"),
    "rm": _client("rm", "remove an installed model (--force unloads it first)"),
    "ps": _client("ps", "what the daemon runs: model, profile, tiers, hit rate, queue"),
    "logs": _client("logs", "the daemon's log, one line per request (-f follows)"),
    "profile": _client("profile", "usage profiles: list | show | use | save | warm"),
    "service": _client("service", "run colibrid as a per-user service (systemd, launchd)"),
    "completion": _client("completion", "shell completion script: bash | zsh | fish"),
    "convert": Command(
        "colibrid.convert.convert",
        "convert a checkpoint (f32/bf16/FP8/NVFP4) into a colibri container",
    ),
    "requant": Command(
        "colibrid.convert.requant",
        "per-expert precision from a usage profile: hot experts precise, cold ones low-bit",
    ),
    "eval": Command(
        "colibrid.quality.command",
        "quality against a reference: KL, top-1 agreement, perplexity, bytes a token",
    ),
    "inspect": Command(
        "colibrid.convert.inspect",
        "describe a container: architecture, formats, expert size (--verify: check its bytes)",
    ),
    "export": Command(
        "colibrid.convert.gguf_export",
        "write a model as GGUF for llama.cpp (--gguf OUT; shards with --split-max-size)",
    ),
    "config": Command(
        "colibrid.config_reference",
        "every config.toml key: type, default, meaning (--toml: an example file)",
    ),
    "synth": Command(
        "colibrid.convert.synth",
        "write a synthetic container with real per-layer shapes for benchmarks",
    ),
    "plan": Command(
        "colibrid.cluster.plan",
        "when one machine is not enough: measured ceilings and the cluster's commands",
    ),
    "llama-build": Command(
        "colibrid.cluster.llama_build",
        "build llama.cpp's RPC programs (rpc-server, llama-server) from the pinned sources",
    ),
}


def _usage() -> str:
    lines = ["usage: colibri COMMAND [options]", "", "commands:"]
    for name, command in COMMANDS.items():
        lines.append(f"  {name:<10} {command.summary}")
        if name == "completion":
            lines.append(f"  {'bench':<10} {BENCH_SUMMARY}")
    lines += ["", "One-shot generation without a daemon: `colibrid generate --help`."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    # the one rule of both entry points for a reader that leaves (`colibri ps | head -3`):
    # no traceback, exit 141; stdlib only, so this is no heavy import
    from colibrid.pipes import quiet_when_reader_leaves

    return quiet_when_reader_leaves(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        print(f"colibri {__version__}")
        return 0
    name, rest = args[0], args[1:]
    command = COMMANDS.get(name)
    if command is None and name != "bench":
        print(f"colibri: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        return _run_bench(rest) if command is None else command.run(name, rest)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
