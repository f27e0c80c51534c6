"""`colibri bench replay`: record a request once, replay it teacher-forced anywhere.

Why: two store configurations must see identical inputs so they differ only in speed and
hit rate (docs/performance.md). ``--record FILE`` runs one greedy generation with every expert
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

from colibrid.backends.base import KernelFamily


def take_pass(store) -> list[tuple[int, list[int]]]:  # noqa: ANN001
    """The routing of the forward pass just run: (layer, experts) per MoE layer."""
    return [(int(layer), [int(e) for e in experts]) for layer, experts in store.take_usage()]


def add_store_flags(p: argparse.ArgumentParser) -> None:
    """The placement flags of `colibrid generate`, and --backend."""
    from colibrid.cli import add_store_arguments
    from colibrid.config import add_backend_flag

    add_store_arguments(p)
    add_backend_flag(p)


def engine_ops(args: argparse.Namespace, family: KernelFamily = KernelFamily.F32):  # noqa: ANN201
    """The ops of the --backend asked for (BackendError, one line, when it cannot run)."""
    from colibrid.engine.backend import make_ops

    return make_ops(args.backend or "auto", family, args.vram_gb)


def store_options(args: argparse.Namespace):  # noqa: ANN201
    from colibrid.cli import store_options as build

    return build(args)


def prompt_ids(model: Path, texts: list[str]) -> list[list[int]]:
    """Token ids of each prompt: a one-message chat when the model has a chat template
    (what a user would send), else the plain encoding."""
    from colibrid.engine.tokenizer import TextCodec

    codec = TextCodec.load(model)
    if codec.has_chat_template:
        return [
            codec.encode_chat([{"role": "user", "content": t}], add_generation_prompt=True)
            for t in texts
        ]
    return [codec.encode(t, add_special_tokens=True) for t in texts]


def record(model: Path, prompts: list[list[int]], max_tokens: int, out: Path) -> None:
    """Greedy-generate each prompt as its own request with every expert resident; save
    the requests and the routing of every forward pass (prefill passes flagged)."""
    from colibrid.engine.engine import Engine
    from colibrid.engine.tokenizer import load_stop_token_ids
    from colibrid.paths import atomic_write
    from colibrid.store.options import StoreOptions

    engine = Engine.load(model, store=StoreOptions(mode="resident"))
    stop = load_stop_token_ids(model)
    store = engine.experts
    store.take_usage()  # starts the feed: from now on every pass is kept
    steps: list[list[tuple[int, list[int]]]] = []
    requests, prefill_steps = [], []
    try:
        for prompt in prompts:
            prefill_steps.append(len(steps))  # index among passes
            session = engine.new_session()
            logits = session.prefill(prompt)
            steps.append(take_pass(store))
            generated: list[int] = []
            while len(generated) < max_tokens:
                token = int(np.argmax(logits))
                generated.append(token)
                if (
                    token in stop
                    or len(generated) == max_tokens
                    or len(prompt) + len(generated) >= engine.max_context
                ):
                    break
                logits = session.decode(token)
                steps.append(take_pass(store))
            requests.append({"prompt_ids": prompt, "generated_ids": generated})
    finally:
        engine.close()
    steps = [s for s in steps if s]
    doc = {
        "model": str(model),
        "requests": requests,
        "prefill_steps": prefill_steps,
        "prompt_ids": requests[0]["prompt_ids"],
        "generated_ids": requests[0]["generated_ids"],
        "trace": [[[la, ex] for la, ex in step] for step in steps],
    }
    atomic_write(out, json.dumps(doc).encode())
    n_prompt = sum(len(r["prompt_ids"]) for r in requests)
    n_gen = sum(len(r["generated_ids"]) for r in requests)
    print(
        f"recorded {len(requests)} request(s): {n_prompt} prompt + {n_gen} generated tokens, "
        f"{len(steps)} forward passes of routing -> {out}"
    )


def requests_of(doc: dict) -> list[dict]:
    """The recorded requests (a single-request file from before ``requests`` existed)."""
    return doc.get("requests") or [
        {"prompt_ids": doc["prompt_ids"], "generated_ids": doc["generated_ids"]}
    ]


def replay(doc: dict, model: Path, args: argparse.Namespace) -> dict:
    """Teacher-force every recorded request in order (request boundaries included, so
    profiles are saved and REPIN runs as in a real session)."""
    from colibrid.engine.engine import Engine

    engine = Engine.load(model, ops=engine_ops(args), store=store_options(args))
    try:
        base = engine.experts.stats.copy()
        agree = n = passes = 0
        prefill_s = decode_s = 0.0
        for req in requests_of(doc):
            session = engine.new_session()
            t0 = time.perf_counter()
            logits = session.prefill(req["prompt_ids"])
            prefill_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            for k, token in enumerate(req["generated_ids"]):
                agree += int(np.argmax(logits)) == token
                n += 1
                if k + 1 < len(req["generated_ids"]):
                    logits = session.decode(token)
                    passes += 1
            decode_s += time.perf_counter() - t0
            engine.request_finished()
        out = {
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "tokens": n,
            "tok_s": passes / decode_s if decode_s else 0.0,
            "agree": agree,
        }
        out["stats"] = engine.experts.statistics(since=base)
        return out
    finally:
        engine.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri bench replay", description=__doc__)
    p.add_argument("--model", type=Path, metavar="DIR")
    p.add_argument("--record", type=Path, metavar="FILE")
    p.add_argument("--replay", type=Path, metavar="FILE")
    p.add_argument("--ids", default="", metavar="1,2,3", help="prompt token ids to record")
    p.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a prompt to record as its own request (repeatable; sent as a chat "
        "message when the model has a chat template)",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        metavar="FILE",
        help="record one request per line of FILE (# comments), e.g. profiles/code/warm.txt",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="generated tokens per request")
    add_store_flags(p)
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    args.parser = p
    if args.record:
        if not args.model:
            p.error("--record needs --model")
        from colibri_cli.commands.profile import read_prompt_file

        texts = list(args.prompt) + (read_prompt_file(args.prompts) if args.prompts else [])
        prompts = prompt_ids(args.model, texts) if texts else []
        ids = [int(x) for x in args.ids.split(",") if x]
        if ids or not prompts:
            prompts.insert(0, ids or [1, 2, 3, 4, 5, 6, 7, 8])
        record(args.model, prompts, args.max_tokens, args.record)
        return 0
    if not args.replay:
        p.error("give --record FILE or --replay FILE")
    doc = json.loads(args.replay.read_text())
    res = replay(doc, args.model or Path(doc["model"]), args)
    print(
        f"replay: {len(requests_of(doc))} request(s), {res['tokens']} tokens "
        f"teacher-forced, decode {res['tok_s']:.2f} tok/s, "
        f"argmax agrees {res['agree']}/{res['tokens']} (must be all)"
    )
    if "stats" in res:
        for line in res["stats"].lines("replay"):
            print(line)
    return 0 if res["agree"] == res["tokens"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
