"""`colibri bench spec`: speculative decoding on and off, on answers that repeat their
input and on free prose.

Two built-in prompts (with the model's chat template when it has a tokenizer; seeded
random ids, 300 of them then their first 40 again, when it has none): "rewrite" asks for
a 300-token function back with one variable renamed (an answer that copies its input:
where prompt lookup pays), "prose" for a short story (where it mostly does not). Each is
answered greedily without speculation and then with each drafter asked for, from an
empty expert cache each time, one request alone. Printed per run: decode tok/s, expert
bytes read per generated token (and, for a streamed model, the roofline those bytes
allow at the O_DIRECT probe of the same run), verifies, tokens emitted per verify pass,
drafts kept, and whether the text equals the one without speculation (it must: the
drafts are checked by the model itself). The prompts' prefill is not counted.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from colibrid.bench.replay import add_store_flags, engine_ops, store_options
from colibrid.bench.workload import (
    PROSE,
    REWRITE,
    flush_cache,
    new_batcher,
    prompt_ids,
    run_together,
)


@dataclass
class Row:
    prompt: str
    speculate: str
    tok_s: float
    gb_per_token: float
    roofline_tok_s: float | None
    verifies: int
    tokens_per_verify: float
    drafted: int
    accepted: int
    mean_depth: float
    same_text: bool


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri bench spec", description=__doc__)
    p.add_argument("--model", required=True, metavar="NAME|DIR", help="model name or folder")
    p.add_argument("--tokens", type=int, default=160, help="tokens each answer generates")
    p.add_argument(
        "--drafters",
        default="ngram",
        metavar="ngram,mtp",
        help="drafters to compare with no speculation (default: ngram)",
    )
    p.add_argument("--draft-max", type=int, default=8, metavar="N", help="deepest draft")
    p.add_argument("--probe-reads", type=int, default=32, help="expert reads of each probe")
    p.add_argument("--json", action="store_true", help="print JSON rows")
    add_store_flags(p)
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    drafters = [d for d in args.drafters.split(",") if d]
    if args.tokens < 2 or not drafters or any(d not in ("ngram", "mtp") for d in drafters):
        p.error("--tokens >= 2; --drafters from ngram, mtp")
    from colibrid.bench.stream import probe
    from colibrid.config import resolve_model
    from colibrid.engine.engine import Engine
    from colibrid.engine.speculate import OFF, SpecSettings
    from colibrid.paths import Paths

    model = Path(resolve_model(Paths.from_env(None), args.model))
    engine = Engine.load(
        model, ops=engine_ops(args), store=store_options(args), mtp="mtp" in drafters
    )
    store = engine.experts
    streams = store.reads_experts()
    gbs = probe(store, args.probe_reads, store.pool.threads or 1)[0] if streams else None
    batcher = new_batcher(engine)
    rows: list[Row] = []
    for name, text in (("rewrite", REWRITE), ("prose", PROSE)):
        ids = prompt_ids(model, engine.vocab_size, [text], repeat=name == "rewrite")
        run_together(engine, ids, 2, batcher=batcher)  # warm-up: pages in, code hot
        plain: list[int] | None = None
        for mode in ["off", *drafters]:
            if streams:
                flush_cache(store)
            spec = OFF if mode == "off" else SpecSettings(mode, args.draft_max)
            run = run_together(engine, ids, args.tokens, speculate=spec, batcher=batcher)
            answer = run.answers[0]
            plain = answer.tokens if plain is None else plain
            st = answer.spec
            verifies = st.verifies if st else 0
            rows.append(
                Row(
                    name,
                    mode,
                    run.decode_tokens / run.decode_wall_s,
                    run.decode_read_bytes / 1e9 / run.decode_tokens,
                    None,
                    verifies,
                    st.spec_tokens / verifies if st and verifies else 1.0,
                    st.drafted if st else 0,
                    st.accepted if st else 0,
                    st.mean_depth if st else 0.0,
                    answer.tokens == plain,
                )
            )
    if streams:
        gbs = max(gbs or 0.0, probe(store, args.probe_reads, store.pool.threads or 1, seed=1)[0])
        for row in rows:
            row.roofline_tok_s = gbs / row.gb_per_token if row.gb_per_token > 0 else None
    engine.close()
    if args.json:
        print(json.dumps({"probe_gb_s": gbs, "rows": [asdict(r) for r in rows]}))
        return 0 if all(r.same_text for r in rows) else 1
    print(f"model: {model} ({'experts stream' if streams else 'experts resident'})")
    if gbs is not None:
        print(f"disk: O_DIRECT probe {gbs:.2f} GB/s (best of before and after)")
    head = ("prompt", "speculate", "tok/s", "GB/token", "roofline", "verifies", "tok/verify")
    print("{:<8} {:<9} {:>8} {:>9} {:>9} {:>8} {:>10}  drafts kept   same text".format(*head))
    base: dict[str, Row] = {}
    for r in rows:
        base.setdefault(r.prompt, r)
        roof = "-" if r.roofline_tok_s is None else f"{r.roofline_tok_s:.2f}"
        kept = f"{r.accepted}/{r.drafted}" if r.drafted else "-"
        speedup = "" if r is base[r.prompt] else f"  {r.tok_s / base[r.prompt].tok_s:.2f}x tok/s"
        saved = ""
        if r is not base[r.prompt] and base[r.prompt].gb_per_token > 0:
            saved = f", {r.gb_per_token / base[r.prompt].gb_per_token:.2f}x the bytes/token"
        print(
            f"{r.prompt:<8} {r.speculate:<9} {r.tok_s:>8.2f} {r.gb_per_token:>9.4f} {roof:>9} "
            f"{r.verifies:>8} {r.tokens_per_verify:>10.2f}  {kept:>11}   "
            f"{'yes' if r.same_text else 'NO'}{speedup}{saved}"
        )
    return 0 if all(r.same_text for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
