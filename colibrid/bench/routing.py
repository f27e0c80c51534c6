"""``colibri bench routing``: how skewed and how domain-dependent the expert selection is.

Each built-in domain profile's prompts (``profiles/<domain>/warm.txt``) are prefilled one
by one (raw text, no chat template, so the shared system prompt does not blur the
domains) and every routed selection is counted per (domain, layer, expert) with the
expert store's counters. Printed per MoE layer:

* ``top20``: the share of a layer's selections taken by its top 20% of experts (all
  domains together); uniform routing gives 20%;
* ``TV code/prose``: the total variation distance between the code and the prose
  selection distributions of that layer (0 = identical, 1 = disjoint);
* ``halves: cross`` / ``within``: the same distance between half-sets of prompts (even /
  odd lines), across domains and within a domain: ``within`` is the sampling-noise
  floor that ``cross`` must clear for the domains to really route differently.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

DOMAINS = ("code", "chat", "math", "prose")


def profile_prompts(domain: str) -> list[str]:
    from colibri_cli.commands.profile import BUILTIN, read_prompt_file

    return read_prompt_file(BUILTIN / domain / "warm.txt")


def count_selections(
    model: str | Path, domains: Sequence[str] = DOMAINS, limit: int | None = None
) -> tuple[dict[str, np.ndarray], list[int]]:
    """{domain: counts [n_layers, n_experts]} and the MoE layer indices."""
    from colibrid.engine.engine import Engine
    from colibrid.engine.tokenizer import TextCodec

    engine = Engine.load(model)
    codec = TextCodec.load(model)
    store = engine.experts
    layers = list(store.layout.moe_layers)
    out: dict[str, np.ndarray] = {}
    try:
        for domain in domains:
            for half in (0, 1):  # even / odd prompts, for the same-domain noise floor
                before = np.array(store.counts, copy=True)
                for text in profile_prompts(domain)[:limit][half::2]:
                    ids = codec.encode(text, add_special_tokens=False)
                    engine.new_session().prefill(ids)
                    engine.request_finished()
                out[f"{domain}/{half}"] = np.array(store.counts, copy=True) - before
            out[domain] = out[f"{domain}/0"] + out[f"{domain}/1"]
    finally:
        engine.close()
    return out, layers


def top_share(counts: np.ndarray, fraction: float = 0.2) -> float:
    """Share of selections taken by the top ``fraction`` of experts (a fractional expert
    counts pro rata, so uniform routing gives exactly ``fraction``)."""
    total = counts.sum()
    if not total:
        return 0.0
    ranked = np.sort(counts)[::-1].astype(np.float64)
    k = fraction * counts.size
    whole = int(math.floor(k))
    part = ranked[whole] * (k - whole) if whole < len(ranked) else 0.0
    return float((ranked[:whole].sum() + part) / total)


def tv_distance(a: np.ndarray, b: np.ndarray) -> float:
    if a.sum() == 0 or b.sum() == 0:
        return 0.0
    return float(0.5 * np.abs(a / a.sum() - b / b.sum()).sum())


def report(counts: dict[str, np.ndarray], layers: Sequence[int]) -> tuple[list[str], dict]:
    """Per layer: top-20% share, TV(code, prose) and its noise floor, the TV between
    half-sets of prompts: cross = TV(code half, prose half), within = TV(code half, other
    code half) and likewise for prose, both at the same sample sizes."""
    domains = [d for d in counts if "/" not in d]
    total = sum(counts[d] for d in domains)
    have = "code" in counts and "prose" in counts
    lines = [f"{'layer':>5} {'top20':>7} {'TV code/prose':>14} {'halves: cross':>14} {'within':>7}"]
    shares, tvs, cross, within = [], [], [], []
    for layer in layers:
        s = top_share(total[layer])
        shares.append(s)
        if have:
            c = {k: v[layer] for k, v in counts.items()}
            tvs.append(tv_distance(c["code"], c["prose"]))
            cross.append(
                0.5
                * (tv_distance(c["code/0"], c["prose/0"]) + tv_distance(c["code/1"], c["prose/1"]))
            )
            within.append(
                0.5
                * (tv_distance(c["code/0"], c["code/1"]) + tv_distance(c["prose/0"], c["prose/1"]))
            )
        else:
            tvs.append(float("nan"))
            cross.append(float("nan"))
            within.append(float("nan"))
        lines.append(
            f"{layer:>5} {100 * s:>6.1f}% {tvs[-1]:>14.3f} {cross[-1]:>14.3f} {within[-1]:>7.3f}"
        )
    summary = {
        "top20_mean": float(np.mean(shares)),
        "top20_min": float(np.min(shares)),
        "top20_max": float(np.max(shares)),
        "tv_mean": float(np.mean(tvs)),
        "tv_min": float(np.min(tvs)),
        "cross_mean": float(np.mean(cross)),
        "within_mean": float(np.mean(within)),
        "layers_cross_above_within": int(sum(a > b for a, b in zip(cross, within, strict=True))),
        "selections": {d: int(counts[d].sum()) for d in domains},
    }
    lines.append(
        f"{'mean':<5} {100 * summary['top20_mean']:>6.1f}% {summary['tv_mean']:>14.3f} "
        f"{summary['cross_mean']:>14.3f} {summary['within_mean']:>7.3f}"
    )
    lines.append(
        f"uniform routing gives top20 = 20% (here {100 * summary['top20_min']:.1f}%.."
        f"{100 * summary['top20_max']:.1f}% per layer); code vs prose differ more "
        f"than same-domain halves in {summary['layers_cross_above_within']}/"
        f"{len(layers)} layers"
    )
    lines.append("selections: " + ", ".join(f"{d} {n}" for d, n in summary["selections"].items()))
    return lines, summary


def default_model() -> Path:
    from colibrid.config import resolve_model
    from colibrid.paths import Paths

    return resolve_model(Paths.from_env(), None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri bench routing", description=__doc__.split("\n")[0])
    p.add_argument("--model", metavar="DIR", help="model directory (default: the demo model)")
    p.add_argument("--limit", type=int, metavar="K", help="only the first K prompts per domain")
    return p


def main(argv: Sequence[str]) -> int:
    a = build_parser().parse_args(list(argv))
    model = Path(a.model) if a.model else default_model()
    counts, layers = count_selections(model, DOMAINS, a.limit)
    lines, _ = report(counts, layers)
    print(f"routing on {model} ({', '.join(DOMAINS)} prompts, prompt tokens only)")
    print("\n".join(lines))
    return 0
