"""`colibri bench policy`: replay recorded routing through each eviction policy offline.

Prints, per cache size (experts per layer), the hit rate of every online policy next to
Belady's optimal for the same budget and trace — the limit measured on the same input.
The trace is the one `colibri bench replay --record` saves (decode passes only unless
--with-prefill).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from colibrid.policy import DEFAULT_POLICY, POLICIES, make_policy, simulate
from colibrid.policy.belady import belady_hits


def per_layer(
    trace: list, with_prefill: bool, prefill_steps: list[int] | None = None
) -> dict[int, list[list[int]]]:
    """Each layer's sequence of expert sets; prefill passes (the first one in a file from
    before ``prefill_steps`` existed) are left out unless asked for."""
    skip = set() if with_prefill else set(prefill_steps if prefill_steps is not None else [0])
    layers: dict[int, list[list[int]]] = {}
    for k, step in enumerate(trace):
        if k in skip:
            continue
        for layer, experts in step:
            layers.setdefault(int(layer), []).append([int(e) for e in experts])
    return layers


def run(
    trace: list,
    caches: list[int],
    with_prefill: bool = False,
    prefill_steps: list[int] | None = None,
) -> list[dict]:
    layers = per_layer(trace, with_prefill, prefill_steps)
    rows = []
    for cap in caches:
        row: dict = {"cache": cap}
        for name in [*POLICIES, "belady"]:
            hits = lookups = 0
            for acc in layers.values():
                h, n = (
                    belady_hits(acc, cap)
                    if name == "belady"
                    else simulate(make_policy(name), acc, cap)
                )
                hits, lookups = hits + h, lookups + n
            row[name] = hits / lookups if lookups else 0.0
        rows.append(row)
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri bench policy", description=__doc__)
    p.add_argument("--trace", type=Path, required=True, metavar="FILE")
    p.add_argument(
        "--cache",
        type=int,
        action="append",
        metavar="N",
        help="experts per layer (repeatable; default 1,2,4,8,16,32)",
    )
    p.add_argument("--with-prefill", action="store_true")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    doc = json.loads(args.trace.read_text())
    rows = run(
        doc["trace"],
        args.cache or [1, 2, 4, 8, 16, 32],
        args.with_prefill,
        doc.get("prefill_steps"),
    )
    names = [*POLICIES, "belady"]
    print(
        f"{'cache':>6} " + " ".join(f"{n:>8}" for n in names) + "   (default: "
        f"{DEFAULT_POLICY}; belady = optimal limit)"
    )
    for row in rows:
        print(f"{row['cache']:>6} " + " ".join(f"{100 * row[n]:7.1f}%" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
