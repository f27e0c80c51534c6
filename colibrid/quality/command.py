"""``colibri eval MODEL --against REF``: a model's quality cost against a reference,
beside the bytes it reads.

MODEL and REF are installed model names or folders (a container, or a Hugging Face
checkpoint the engine reads, such as the demo's f32 export). The report: mean KL
divergence KL(REF ‖ MODEL) of the next-token distributions, top-1 agreement and
perplexity (both models, on the reference's own greedy continuations of the built-in
profile prompts: colibrid/quality/evaluate.py), the precision plans of both, the expert
bytes a token each reads, and with ``--stream-ram-gb`` the streamed decode speed of
MODEL at that RAM budget. Deterministic: the same models give the same figures (the
speed aside). Progress goes to stderr; ``--json`` prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from colibrid.errors import ColibriError
from colibrid.quality.evaluate import (
    EvalSettings,
    Reference,
    build_reference,
    score_model,
    stream_speed,
)


def resolve_model(name: str) -> Path:
    """An existing folder as given, else the installed model of that name."""
    from colibrid.paths import Paths

    path = Path(name)
    if path.is_dir():
        return path
    installed = Paths.from_env().models / name
    if installed.is_dir():
        return installed
    raise ColibriError(f"{name}: no such folder and no installed model of that name")


def evaluate(
    model: Path,
    ref: Reference,
    *,
    stream_ram_gb: float | None = None,
    say=lambda msg: None,  # type: ignore[no-untyped-def]
) -> dict:
    """The report of ``model`` against the prepared reference (JSON-ready)."""
    run = score_model(model, ref, say)
    report: dict = {
        "model": str(model),
        "reference": str(ref.path),
        **run.scores.summary(),
        "sequences": len(ref.sequences),
        "expert_bytes_per_token": run.expert_bytes_per_token,
        "plan": run.plan,
        "reference_expert_bytes_per_token": ref.expert_bytes_per_token,
        "reference_plan": ref.plan,
    }
    if stream_ram_gb is not None:
        say(f"streaming {model.name} at {stream_ram_gb:g} GB of RAM")
        report["stream"] = stream_speed(model, stream_ram_gb, ref.sequences[0], ref.starts[0])
    return report


def render(report: dict) -> str:
    ref_bytes = report["reference_expert_bytes_per_token"]
    own = report["expert_bytes_per_token"]
    lines = [
        f"model:     {report['model']}  (plan {report['plan']['id']})",
        f"reference: {report['reference']}  (plan {report['reference_plan']['id']})",
        f"positions: {report['positions']} over {report['sequences']} sequences "
        "(the reference's greedy continuations of the built-in profile prompts)",
        f"KL(ref||model): mean {report['kl_mean']:.6f} nats, max {report['kl_max']:.4f}",
        f"top-1 agreement: {100 * report['top1_agreement']:.2f}%",
        f"perplexity: model {report['ppl_model']:.4f}, reference {report['ppl_ref']:.4f} "
        f"({100 * (report['ppl_model'] / report['ppl_ref'] - 1):+.2f}%)",
        f"expert bytes a token: {report['expert_bytes_per_token'] / 1e6:.3f} MB"
        + (f" (reference {ref_bytes / 1e6:.3f} MB, {own / ref_bytes:.3f}x)" if ref_bytes else ""),
    ]
    stream = report.get("stream")
    if stream:
        if "tok_s" in stream:
            roof = stream["roofline_tok_s"]
            lines.append(
                f"streamed at {stream['ram_gb']:g} GB RAM: {stream['tok_s']:.3f} tok/s, "
                f"{stream['gb_read_per_token']:.4f} GB read a token"
                + (f"; disk roofline {roof:.3f} tok/s" if roof else "")
            )
        else:
            lines.append(f"streamed at {stream['ram_gb']:g} GB RAM: {stream['note']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri eval",
        description="Quality of MODEL against REF, teacher-forced on the reference's own "
        "greedy continuations of the built-in profile prompts (no download): mean KL "
        "divergence of the next-token distributions, top-1 agreement, perplexity, and the "
        "expert bytes a token reads.",
    )
    p.add_argument("model", metavar="MODEL", help="installed model name or folder")
    p.add_argument(
        "--against",
        required=True,
        metavar="REF",
        help="the reference: the source checkpoint (e.g. an f32 export) or another "
        "container (e.g. the uniform one), by name or folder",
    )
    p.add_argument("--prompts", type=int, default=4, help="prompts per built-in domain (4)")
    p.add_argument("--tokens", type=int, default=32, help="reference tokens per prompt (32)")
    p.add_argument(
        "--stream-ram-gb",
        type=float,
        metavar="GB",
        help="also decode MODEL with its experts streamed at this RAM budget: tok/s and "
        "GB read a token beside the disk roofline",
    )
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def main(argv: Sequence[str]) -> int:
    a = build_parser().parse_args(list(argv))
    if a.prompts < 1 or a.tokens < 1:
        print("colibri eval: error: --prompts and --tokens must be >= 1", file=sys.stderr)
        return 2

    def say(msg: str) -> None:
        if not a.quiet:
            print(f"colibri eval: {msg}", file=sys.stderr, flush=True)

    model, ref_path = resolve_model(a.model), resolve_model(a.against)
    ref = build_reference(ref_path, EvalSettings(a.prompts, a.tokens), say)
    report = evaluate(model, ref, stream_ram_gb=a.stream_ram_gb, say=say)
    print(json.dumps(report, indent=1, sort_keys=True) if a.json else render(report))
    return 0
