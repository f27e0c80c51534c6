"""`colibri bench replay`: record a request once, replay it teacher-forced anywhere.

Why: two store configurations must see identical inputs so they differ only in speed and
hit rate (DESIGN §9). ``--record FILE`` runs one greedy generation with every expert
resident and saves the prompt, the generated ids and the routing trace (per forward pass,
per MoE layer, the union of chosen experts: what `colibri bench policy` replays).
``--replay FILE`` prefills the prompt and decodes the recorded tokens (not sampled ones)
through the configuration given by the placement flags, and prints decode tok/s, the
store telemetry and whether every argmax still matches the recording (it must).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


class TracingStore:
    """Wraps an expert store and remembers every record() call, split by forward pass."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner = inner
        self.steps: list[list[tuple[int, list[int]]]] = [[]]

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    def record(self, layer: int, experts) -> None:  # noqa: ANN001
        self.steps[-1].append((int(layer), [int(e) for e in experts]))
        self.inner.record(layer, experts)

    def between_tokens(self, wall_s: float = 0.0) -> None:
        self.steps.append([])
        hook = getattr(self.inner, "between_tokens", None)
        if hook is not None:
            hook(wall_s)


def add_store_flags(p: argparse.ArgumentParser) -> None:
    from colibrid.cli import add_store_arguments

    add_store_arguments(p)


def store_options(args: argparse.Namespace):  # noqa: ANN201
    from colibrid.cli import store_options as build

    return build(args)


def record(model: Path, prompt: list[int], max_tokens: int, out: Path) -> None:
    from colibrid.engine.engine import Engine
    from colibrid.store.options import StoreOptions

    engine = Engine.load(model, store=StoreOptions(mode="resident"))
    tracer = TracingStore(engine.experts)
    engine.experts = tracer
    for layer in engine.model.layers:  # the MoE blocks hold the store too
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts = tracer
    session = engine.new_session()
    logits = session.prefill(prompt)
    generated = []
    for _ in range(max_tokens):
        token = int(np.argmax(logits))
        generated.append(token)
        if len(prompt) + len(generated) >= engine.max_context:
            break
        logits = session.decode(token)
    steps = [s for s in tracer.steps if s]
    doc = {"model": str(model), "prompt_ids": prompt, "generated_ids": generated,
           "trace": [[[la, ex] for la, ex in step] for step in steps]}
    out.write_text(json.dumps(doc))
    engine.close()
    print(f"recorded {len(prompt)} prompt + {len(generated)} generated tokens, "
          f"{len(steps)} forward passes of routing -> {out}")


def replay(doc: dict, model: Path, args: argparse.Namespace) -> dict:
    from colibrid.engine.engine import Engine

    engine = Engine.load(model, store=store_options(args))
    try:
        session = engine.new_session()
        t0 = time.perf_counter()
        logits = session.prefill(doc["prompt_ids"])
        prefill_s = time.perf_counter() - t0
        stats0 = getattr(engine.experts, "stats", None)
        base = stats0.copy() if stats0 is not None else None
        agree = 0
        t0 = time.perf_counter()
        for token in doc["generated_ids"]:
            agree += int(np.argmax(logits)) == token
            logits = session.decode(token)
        decode_s = time.perf_counter() - t0
        n = len(doc["generated_ids"])
        out = {"prefill_s": prefill_s, "decode_s": decode_s, "tokens": n,
               "tok_s": n / decode_s if decode_s else 0.0, "agree": agree}
        if base is not None:
            out["stats"] = engine.experts.statistics(since=base)
        engine.request_finished()
        return out
    finally:
        engine.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="colibri bench replay", description=__doc__)
    p.add_argument("--model", type=Path, metavar="DIR")
    p.add_argument("--record", type=Path, metavar="FILE")
    p.add_argument("--replay", type=Path, metavar="FILE")
    p.add_argument("--ids", default="", metavar="1,2,3", help="prompt token ids to record")
    p.add_argument("--max-tokens", type=int, default=32)
    add_store_flags(p)
    args = p.parse_args(argv)
    args.parser = p
    if args.record:
        if not args.model:
            p.error("--record needs --model")
        prompt = [int(x) for x in args.ids.split(",") if x] or [1, 2, 3, 4, 5, 6, 7, 8]
        record(args.model, prompt, args.max_tokens, args.record)
        return 0
    if not args.replay:
        p.error("give --record FILE or --replay FILE")
    doc = json.loads(args.replay.read_text())
    res = replay(doc, args.model or Path(doc["model"]), args)
    print(f"replay: {res['tokens']} tokens teacher-forced, decode {res['tok_s']:.2f} tok/s, "
          f"argmax agrees {res['agree']}/{res['tokens']} (must be all)")
    if "stats" in res:
        for line in res["stats"].lines("replay"):
            print(line)
    return 0 if res["agree"] == res["tokens"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
