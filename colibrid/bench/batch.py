"""`colibri bench batch`: 1, 2, 4 and 8 concurrent greedy requests decoded together.

When experts stream from disk a decode step costs the bytes of the experts its rows route
to that are not resident; requests decoded together fetch the union of their experts once
per layer. For each concurrency the same model and placement answers that many built-in
questions at once (the engine's batcher: what the daemon does) and prints the aggregate
tok/s, the expert bytes read per generated token and the roofline those bytes allow at
the drive's speed, measured in the same run (an O_DIRECT probe of the model's own expert
extents, before and after; the faster is the limit). Beside the bytes read stands the
fewest any cache of the same size could have read for the same routing (Belady's optimum,
recorded in the run, from the best possible starting content): the limit of the cache
policy, as the probe is the drive's. The figures are the decode steps' (from the step
every request has its first token); the prompts' prefill is not counted. Each answer is
checked against the same question asked alone: batching must not change a byte. The cache
is emptied before each concurrency, so none starts warmer than another.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from colibrid.bench.cache_bound import fewest_read_bytes
from colibrid.bench.replay import add_store_flags, engine_ops, store_options
from colibrid.bench.workload import (
    QUESTIONS,
    flush_cache,
    new_batcher,
    prompt_ids,
    run_together,
)


@dataclass
class Row:
    requests: int
    tok_s: float
    tokens: int
    gb_per_token: float
    fewest_gb_per_token: float | None  # what any cache of this size must read (Belady)
    roofline_tok_s: float | None
    same_as_alone: bool


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri bench batch", description=__doc__)
    p.add_argument("--model", required=True, metavar="NAME|DIR", help="model name or folder")
    p.add_argument(
        "--concurrency",
        default="1,2,4,8",
        metavar="1,2,4,8",
        help="requests decoded together, one run each (default 1,2,4,8)",
    )
    p.add_argument("--tokens", type=int, default=32, help="tokens each request generates")
    p.add_argument("--probe-reads", type=int, default=32, help="expert reads of each probe")
    p.add_argument("--json", action="store_true", help="print JSON rows")
    add_store_flags(p)
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        levels = sorted({int(x) for x in args.concurrency.split(",") if x})
    except ValueError:
        p.error("--concurrency takes comma-separated integers")
    if not levels or min(levels) < 1 or max(levels) > len(QUESTIONS) or args.tokens < 1:
        p.error(f"--concurrency values in 1..{len(QUESTIONS)}, --tokens >= 1")
    from colibrid.bench.stream import probe
    from colibrid.config import resolve_model
    from colibrid.engine.engine import Engine
    from colibrid.paths import Paths

    model = resolve_model(Paths.from_env(None), args.model)
    engine = Engine.load(model, ops=engine_ops(args), store=store_options(args))
    store = engine.experts
    streams = store.reads_experts()
    prompts = prompt_ids(Path(model), engine.vocab_size, QUESTIONS[: max(levels)])
    gbs = None
    if streams:
        threads = store.pool.threads or 1
        gbs, _ = probe(store, args.probe_reads, threads)
    batcher = new_batcher(engine)
    run_together(engine, prompts[:1], 2, batcher=batcher)  # warm-up: pages in, code hot
    alone = []
    rows: list[Row] = []
    for n in levels:
        if streams:
            flush_cache(store)
        if n == 1:  # every question alone: the single-request figure and the references
            runs = [run_together(engine, [q], args.tokens, batcher=batcher) for q in prompts]
            alone = [r.answers[0].tokens for r in runs]
            same = True
        else:
            runs = [run_together(engine, prompts[:n], args.tokens, batcher=batcher)]
            same = [a.tokens for a in runs[0].answers] == alone[:n]
        wall = sum(r.decode_wall_s for r in runs)
        tokens = sum(r.decode_tokens for r in runs)
        read = sum(r.decode_read_bytes for r in runs)
        fewest = (
            sum(fewest_read_bytes(store, r.decode_trace) for r in runs) / 1e9 / tokens
            if streams
            else None
        )
        rows.append(Row(n, tokens / wall, tokens, read / 1e9 / tokens, fewest, None, same))
    if streams:
        after, _ = probe(store, args.probe_reads, store.pool.threads or 1, seed=1)
        gbs = max(gbs or 0.0, after)
        for row in rows:
            row.roofline_tok_s = gbs / row.gb_per_token if row.gb_per_token > 0 else None
    engine.close()
    if args.json:
        print(json.dumps({"probe_gb_s": gbs, "rows": [asdict(r) for r in rows]}))
        return 0
    print(f"model: {model} ({'experts stream' if streams else 'experts resident'})")
    if gbs is not None:
        print(f"disk: O_DIRECT probe {gbs:.2f} GB/s (best of before and after)")
    head = (
        "requests",
        "tok/s",
        "GB read/token",
        "fewest GB/token",
        "roofline tok/s",
        "same as alone",
    )
    print("{:>8} {:>9} {:>14} {:>16} {:>15} {:>14}".format(*head))
    single = rows[0].gb_per_token if rows and rows[0].requests == 1 else None
    for r in rows:
        roof = "-" if r.roofline_tok_s is None else f"{r.roofline_tok_s:.2f}"
        fewest = "-" if r.fewest_gb_per_token is None else f"{r.fewest_gb_per_token:.4f}"
        share = ""
        if single and r.requests > 1:
            share = f"  ({r.gb_per_token / single:.2f}x the bytes of one alone"
            if r.fewest_gb_per_token is not None:
                share += f"; any cache of this size: >= {r.fewest_gb_per_token / single:.2f}x"
            share += ")"
        print(
            f"{r.requests:>8} {r.tok_s:>9.2f} {r.gb_per_token:>14.4f} {fewest:>16} {roof:>15} "
            f"{'yes' if r.same_as_alone else 'NO':>14}{share}"
        )
    return 0 if all(r.same_as_alone for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
