"""``colibri bench routing``: how skewed and how domain-dependent the expert selection is.

Each built-in domain profile's prompts (``profiles/<domain>/warm.txt``) are prefilled one
by one (raw text, no chat template, so the shared system prompt does not blur the
domains) and every routed selection is counted per (domain, layer, expert) with the
expert store's counters. Printed per MoE layer:

* ``top20``: the share of a layer's selections taken by its top 20% of experts (all
  domains together); uniform routing gives 20%;
* ``TV code/prose``: the total variation distance between the code and the prose
  selection distributions of that layer (0 = identical, 1 = disjoint).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

DOMAINS = ("code", "chat", "math", "prose")


def profile_prompts(domain: str) -> list[str]:
    from colibri_cli.commands.profile import BUILTIN

    path = BUILTIN / domain / "warm.txt"
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def count_selections(model: str | Path, domains: Sequence[str] = DOMAINS,
                     limit: int | None = None) -> tuple[dict[str, np.ndarray], list[int]]:
    """{domain: counts [n_layers, n_experts]} and the MoE layer indices."""
    from colibrid.engine.engine import Engine
    from colibrid.engine.tokenizer import TextCodec

    engine = Engine.load(model)
    codec = TextCodec.load(model)
    store = engine.experts
    if not hasattr(store, "counts"):
        raise SystemExit("this expert store keeps no selection counters")
    layers = list(store.layout.moe_layers)
    out: dict[str, np.ndarray] = {}
    try:
        for domain in domains:
            before = np.array(store.counts, copy=True)
            for text in profile_prompts(domain)[:limit]:
                ids = codec.encode(text, add_special_tokens=False)
                engine.new_session().prefill(ids)
                engine.request_finished()
            out[domain] = np.array(store.counts, copy=True) - before
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
    total = sum(counts.values())
    lines = [f"{'layer':>5} {'top20':>7} {'TV code/prose':>14}"]
    shares, tvs = [], []
    for layer in layers:
        s = top_share(total[layer])
        tv = tv_distance(counts["code"][layer], counts["prose"][layer]) \
            if "code" in counts and "prose" in counts else float("nan")
        shares.append(s)
        tvs.append(tv)
        lines.append(f"{layer:>5} {100 * s:>6.1f}% {tv:>14.3f}")
    summary = {"top20_mean": float(np.mean(shares)), "top20_min": float(np.min(shares)),
               "tv_mean": float(np.mean(tvs)), "tv_min": float(np.min(tvs)),
               "selections": {d: int(c.sum()) for d, c in counts.items()}}
    lines.append(f"mean  {100 * summary['top20_mean']:>6.1f}% {summary['tv_mean']:>14.3f}"
                 f"   (uniform routing: top20 = 20%; min top20 {100 * summary['top20_min']:.1f}%,"
                 f" min TV {summary['tv_min']:.3f})")
    lines.append("selections: " + ", ".join(f"{d} {n}" for d, n in
                                            summary["selections"].items()))
    return lines, summary


def default_model() -> Path:
    from colibrid.config import resolve_model
    from colibrid.paths import Paths

    return resolve_model(Paths.from_env(), None)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="colibri bench routing", description=__doc__.split("\n")[0])
    p.add_argument("--model", metavar="DIR", help="model directory (default: the demo model)")
    p.add_argument("--limit", type=int, metavar="K", help="only the first K prompts per domain")
    a = p.parse_args(list(argv))
    model = Path(a.model) if a.model else default_model()
    counts, layers = count_selections(model, DOMAINS, a.limit)
    lines, _ = report(counts, layers)
    print(f"routing on {model} ({', '.join(DOMAINS)} prompts, prompt tokens only)")
    print("\n".join(lines))
    return 0
