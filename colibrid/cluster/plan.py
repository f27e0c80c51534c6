"""``colibri plan MODEL --hosts N [--gpus G]``: when one machine stops being enough, and
the exact commands for the cluster that takes over.

Why: colibri's promise is one ordinary machine; a team that outgrows it should move to an
existing distributed engine (llama.cpp RPC on CPU hosts, vLLM or SGLang with expert
parallelism on GPU nodes) without guessing at either side. The plan measures this machine
on this model (cluster/measure.py: every figure names its measurement), sets the decode
ceilings beside the user's target (cluster/forecast.py), and prints the command lines
for each host (cluster/launch.py), colibri staying in front as the door the users' tools
already know (docs/beyond-one-machine.md).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from colibrid.cluster import forecast, launch
from colibrid.cluster.llama_build import cache_dir
from colibrid.cluster.measure import Figure, Measured, is_container, measure
from colibrid.errors import ClusterError
from colibrid.remote.spec import REMOTE_FILE
from colibrid.store.budget import GiB
from colibrid.store.checkpoint import Checkpoint

_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri plan",
        description=(
            "Measure this machine on MODEL (its headers, the O_DIRECT disk probe over its "
            "experts, the memory-bandwidth probe, the RAM budget), print the decode "
            "ceiling of one machine and of N hosts like it beside --target-tok-s, and the "
            "commands that run the model on N hosts: llama.cpp RPC on CPU hosts (the "
            "GGUF of `colibri export`), or with --gpus vLLM and SGLang with expert "
            "parallelism (the original checkpoint); colibri stays in front "
            "(`colibri pull http://... --name`). Every figure names its measurement."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="an installed model's name, or a folder")
    p.add_argument("--hosts", type=int, required=True, metavar="N", help="machines to plan for")
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        metavar="G",
        help="GPUs per host: plan vLLM and SGLang expert parallelism instead of llama.cpp RPC",
    )
    p.add_argument(
        "--target-tok-s",
        type=float,
        default=None,
        metavar="X",
        help="decode tokens a second one request needs: the plan says which setup reaches it",
    )
    p.add_argument(
        "--addresses",
        default=None,
        metavar="H1,H2,...",
        help="each host's address as the others reach it, HOST or HOST:PORT (the rpc-server "
        f"port, default {launch.RPC_PORT}); default HOST1, HOST2, ... to replace",
    )
    p.add_argument(
        "--ram-gb",
        type=float,
        default=None,
        metavar="N",
        help="RAM budget of each host (default: this machine's, as the daemon computes it)",
    )
    p.add_argument(
        "--gguf",
        default=None,
        metavar="FILE",
        help="where `colibri export` writes the GGUF on host 1 (default MODEL.gguf)",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR|REPO",
        help="with --gpus: the original Hugging Face checkpoint vLLM and SGLang load "
        "(default MODEL, when MODEL is not a colibri container)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="the engine's HTTP port on host 1's loopback (default: llama-server "
        f"{launch.LLAMA_PORT}, vLLM {launch.VLLM_PORT}, SGLang {launch.SGLANG_PORT})",
    )
    p.add_argument(
        "--name",
        default="team",
        help="the name colibri gives the cluster's model (`colibri pull ... --name`)",
    )
    return p


def endpoints(text: str | None, hosts: int) -> list[launch.Endpoint]:
    """The hosts' addresses (HOST or HOST:PORT), HOST1... when none are given."""
    if text is None:
        return [launch.Endpoint(f"HOST{i}") for i in range(1, hosts + 1)]
    parts = [x.strip() for x in text.split(",")]
    if len(parts) != hosts:
        raise ClusterError(f"--addresses names {len(parts)} hosts, --hosts says {hosts}")
    out = []
    for part in parts:
        host, _, port = part.partition(":")
        if not _HOST.match(host):
            raise ClusterError(f"--addresses: {part!r} is not a host name or IPv4 address")
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ClusterError(f"--addresses: {part!r} has no valid port")
        out.append(launch.Endpoint(host, int(port) if port else launch.RPC_PORT))
    if len(set(out)) != len(out):
        raise ClusterError("--addresses: two hosts share an address and port")
    return out


def home_relative(path: Path) -> str:
    """``~/...`` when under the home folder (each host expands it to its own)."""
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)


def original_checkpoint(a: argparse.Namespace, path: Path) -> tuple[str, Path | None]:
    """What vLLM and SGLang load, and its folder when it is local: MODEL when it is an
    original checkpoint, else --checkpoint (a folder, or a Hugging Face repo id)."""
    if a.checkpoint is None:
        if is_container(path):
            raise ClusterError(
                f"--gpus needs --checkpoint DIR|REPO: vLLM and SGLang load the original "
                f"Hugging Face checkpoint, and {a.model} is a colibri container"
            )
        return str(path), path
    folder = Path(a.checkpoint).expanduser()
    if folder.is_dir():
        if is_container(folder):
            raise ClusterError(
                f"--checkpoint {a.checkpoint} is a colibri container: vLLM and SGLang need "
                "the original Hugging Face checkpoint it was converted from"
            )
        return str(folder.resolve()), folder.resolve()
    if _REPO.match(a.checkpoint):
        return a.checkpoint, None
    raise ClusterError(f"--checkpoint {a.checkpoint!r} is neither a folder nor a repo id")


def checkpoint_size(folder: Path | None) -> str:
    if folder is None:
        return "not measured (a Hugging Face repo id: the plan reads no network)"
    with Checkpoint.open(folder) as ckpt:
        size = sum(f.size for f in ckpt.files)
        count = len(ckpt.files)
    return f"{size / 1e9:.3f} GB (safetensors headers: {count} files)"


def rate(tok_s: float) -> str:
    """A tok/s figure to three significant digits, without exponents."""
    return f"{tok_s:.0f}" if tok_s >= 100 else f"{tok_s:.3g}"


def figure_lines(m: Measured) -> list[str]:
    def row(label: str, value: str, fig: Figure) -> str:
        return f"  {label:<15} {value:<12} {fig.source}"

    out = [
        "measured on this machine",
        row("weights", f"{m.weights.value / 1e9:.3f} GB", m.weights),
        row("a token reads", f"{m.token_bytes.value / 1e9:.4f} GB", m.token_bytes),
        row("cold experts", f"{m.cold_bytes.value / 1e9:.4f} GB", m.cold_bytes),
        f"  {'KV cache':<15} {m.report.kv_bytes / GiB:.3f} GiB    "
        f"safetensors headers: at a {m.report.context}-token context",
        row("RAM budget", f"{m.ram.value / GiB:.1f} GiB", m.ram),
        row("memory", f"{m.memory_gbs.value:.1f} GB/s", m.memory_gbs),
    ]
    if m.disk_gbs is not None:
        out.append(row("disk", f"{m.disk_gbs.value:.2f} GB/s", m.disk_gbs))
    else:
        out.append(f"  {'disk':<15} {'-':<12} not probed: this model streams no experts")
    return out


def verdict(m: Measured, one: forecast.Ceiling, hosts: int, target: float | None) -> str:
    """One machine, ``hosts`` hosts, more hosts, or GPUs: the first that reaches the target."""
    if target is None:
        return "target          none given (--target-tok-s X compares each ceiling with X)"
    head = f"target          {target:g} tok/s:"
    if one.tok_s >= target:
        return (
            f"{head} one machine is enough (ceiling {rate(one.tok_s)}); more hosts add room "
            "for concurrent requests, not speed for one"
        )
    resident = forecast.memory_ceiling(m)
    if resident.tok_s < target:
        return (
            f"{head} no cluster of hosts like this one reaches it for one request (ceiling "
            f"{rate(resident.tok_s)} with every weight in RAM: the memory bus bounds each "
            "token); plan GPU nodes with --gpus G"
        )
    least = forecast.hosts_needed(m)
    if least <= hosts:
        return (
            f"{head} one machine is not enough; {hosts} hosts are (ceiling {rate(resident.tok_s)})"
        )
    return (
        f"{head} one machine is not enough, nor are {hosts} hosts; {least} hosts like this one "
        f"are (ceiling {rate(resident.tok_s)})"
    )


def gpu_verdict(one: forecast.Ceiling, target: float | None) -> str:
    """With --gpus: this machine's ceiling against the target (no GPU is measured here)."""
    if target is None:
        return "target          none given (--target-tok-s X compares the ceiling with X)"
    if one.tok_s >= target:
        return (
            f"target          {target:g} tok/s: one machine is enough (ceiling "
            f"{rate(one.tok_s)}); GPU nodes add room for concurrent requests"
        )
    return (
        f"target          {target:g} tok/s: one machine is not enough (ceiling "
        f"{rate(one.tok_s)}); what the GPU nodes reach is not measured here"
    )


def run(a: argparse.Namespace) -> list[str]:
    from colibrid.config import resolve_model
    from colibrid.paths import Paths

    path = resolve_model(Paths.from_env(None), a.model)
    if (path / REMOTE_FILE).is_file():
        raise ClusterError(
            f"{a.model} is a remote model (an endpoint colibri forwards to): a plan needs the "
            "weights, so give the container or checkpoint it serves"
        )
    hosts = endpoints(a.addresses, a.hosts)
    checkpoint, folder = original_checkpoint(a, path) if a.gpus is not None else ("", None)
    print(f"colibri plan: measuring {path.name} (headers, disk and memory probes)", file=sys.stderr)
    m = measure(path, ram_gb=a.ram_gb)
    one = forecast.one_machine(m)
    many, fit = forecast.cluster(m, a.hosts)
    machines = f"{a.hosts} host" + ("s" if a.hosts > 1 else "")
    gpus = "" if a.gpus is None else f" with {a.gpus} GPU" + ("s" if a.gpus > 1 else "") + " each"
    out = [f"plan for {path.name} on {machines}{gpus}", "", *figure_lines(m), ""]
    if one.tok_s > 0:
        out.append(f"one machine     ceiling {rate(one.tok_s)} tok/s, {one.bound}-bound: {one.how}")
    else:
        out.append(f"one machine     cannot run it: {one.how}")
    if a.gpus is not None:
        out += [gpu_verdict(one, a.target_tok_s), ""]
    elif many is None:
        out.append(f"{a.hosts} hosts         {fit}")
    else:
        out.append(
            f"{a.hosts} hosts         ceiling {rate(many.tok_s)} tok/s a request, "
            f"{many.bound}-bound ({many.how}), less one network round trip per host a "
            f"token (not measured here); {fit}"
        )
    if a.gpus is None:
        out += [verdict(m, one, a.hosts, a.target_tok_s), ""]
    if a.gpus is None:
        gguf = a.gguf or f"{path.name}.gguf"
        bin_dir = home_relative(cache_dir() / "bin")
        steps = launch.llama_rpc(
            hosts,
            bin_dir=bin_dir,
            model=a.model,
            gguf=gguf,
            name=a.name,
            context=m.report.context,
            port=a.port or launch.LLAMA_PORT,
        )
        out.append("commands: llama.cpp RPC (CPU hosts, the GGUF export of the container)")
        out += step_lines(steps)
        return out
    size = checkpoint_size(folder)
    nodes = [h.host for h in hosts]
    out.append(
        f"GPU nodes       {a.hosts} x {a.gpus} GPUs, experts split over all {a.hosts * a.gpus}; "
        f"checkpoint {checkpoint}: {size}; no GPU is measured here: its memory must hold its "
        "share of the weights plus the KV cache"
    )
    out += ["", "commands: vLLM (expert parallel)"]
    out += step_lines(
        launch.vllm(
            nodes, a.gpus, checkpoint=checkpoint, name=a.name, port=a.port or launch.VLLM_PORT
        )
    )
    out += ["", "commands: SGLang (expert parallel)"]
    out += step_lines(
        launch.sglang(
            nodes, a.gpus, checkpoint=checkpoint, name=a.name, port=a.port or launch.SGLANG_PORT
        )
    )
    return out


def step_lines(steps: Sequence[launch.Step]) -> list[str]:
    out: list[str] = []
    for step in steps:
        out += [f"# {step.where}", step.line()]
    return out


def main(argv: Sequence[str]) -> int:
    p = build_parser()
    a = p.parse_args(list(argv))
    if a.hosts < 1:
        p.error("--hosts must be at least 1")
    if a.hosts == 1 and a.gpus is None:
        p.error("--hosts 1 without --gpus is this machine, which colibri already runs")
    if a.gpus is not None and a.gpus < 1:
        p.error("--gpus must be at least 1")
    if a.gpus is not None and a.gguf is not None:
        p.error("--gguf is for llama.cpp RPC; with --gpus, vLLM and SGLang load --checkpoint")
    if a.gpus is None and a.checkpoint is not None:
        p.error("--checkpoint goes with --gpus (llama.cpp RPC loads the GGUF export)")
    if a.target_tok_s is not None and not a.target_tok_s > 0:
        p.error("--target-tok-s must be positive")
    if a.port is not None and not 0 < a.port < 65536:
        p.error("--port must be a TCP port, 1-65535")
    if a.ram_gb is not None and not a.ram_gb > 0:
        p.error("--ram-gb must be positive")
    print("\n".join(run(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
