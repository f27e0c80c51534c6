"""The requests `colibri bench batch` and `colibri bench spec` run, and how they run them:
built-in prompts (with a model's chat template when it has a tokenizer, seeded random
ids when it has none) and the engine's own batcher driving several generations at once,
so a benchmark measures what the daemon does."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from colibrid.bench.replay import take_pass
from colibrid.engine.batcher import Batcher, Member
from colibrid.engine.engine import Engine
from colibrid.engine.events import DoneEvent, TokenEvent
from colibrid.engine.request_run import RequestRun
from colibrid.engine.sampling import SamplingParams
from colibrid.engine.speculate import OFF, SpecSettings, SpecStats
from colibrid.errors import ColibriError

QUESTIONS = (
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "What is 17 times 23? Explain.",
    "List three uses of copper.",
    "How do bees make honey?",
    "Describe a sunrise over the mountains.",
    "What causes the seasons on Earth?",
    "Give two tips for writing clear code.",
)

CODE_BLOCK = '''def summarize(items, key=None, limit=10):
    """Return the most common values in items, most frequent first."""
    counts = {}
    for item in items:
        value = item if key is None else key(item)
        if value is None:
            continue
        counts[value] = counts.get(value, 0) + 1
    ranked = sorted(counts.items(), key=lambda pair: (-pair[1], str(pair[0])))
    result = []
    for value, count in ranked[:limit]:
        share = count / max(len(items), 1)
        result.append({"value": value, "count": count, "share": round(share, 3)})
    if not result:
        return {"total": len(items), "top": [], "note": "no values"}
    total = sum(entry["count"] for entry in result)
    return {"total": len(items), "top": result, "covered": total}
'''

REWRITE = (
    "Rewrite this Python function with the variable `items` renamed to `records`. "
    "Output only the code.\n\n" + CODE_BLOCK
)
PROSE = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def prompt_ids(
    model: Path, vocab: int, texts: Sequence[str], *, repeat: bool = False
) -> list[list[int]]:
    """Each text as a user message in the model's chat template (its plain encoding
    without one); a model without a tokenizer gets seeded random ids instead, 300 of them
    followed by their first 40 again when `repeat` (an input the answer could copy)."""
    if (model / "tokenizer.json").is_file():
        from colibrid.bench.replay import prompt_ids as encode

        return encode(model, list(texts))
    out = []
    for k, _ in enumerate(texts):
        ids = [int(t) for t in np.random.default_rng(k).integers(1, vocab, 300 if repeat else 24)]
        out.append(ids + ids[:40] if repeat else ids)
    return out


@dataclass
class Answer:
    tokens: list[int] = field(default_factory=list)
    finish: str = ""
    spec: SpecStats | None = None
    error: str | None = None


@dataclass
class Run:
    answers: list[Answer]
    wall_s: float
    tokens: int  # generated, over every answer
    passes: int
    decode_rows: int
    decode_wall_s: float  # from the step every answer had its first token (prompts done)
    decode_tokens: int  # the tokens generated in that time
    decode_read_bytes: int  # expert bytes the store read in that time
    # the routing of every pass in that time (`take_pass`: what a cache saw)
    decode_trace: list = field(default_factory=list)


class _Collect:
    """The batcher's listener: keeps each member's tokens and end."""

    def token(self, member: Member, event: TokenEvent) -> None:
        member.tag.tokens.append(event.token_id)

    def done(self, member: Member, event: DoneEvent) -> None:
        member.tag.finish = event.finish_reason
        member.tag.spec = event.spec

    def failed(self, member: Member, code: str, message: str) -> None:
        member.tag.error = f"{code} {message}"

    def passed(self, members: Sequence[Member]) -> None:
        pass


def run_together(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    stop_token_ids: frozenset[int] = frozenset(),
    speculate: SpecSettings = OFF,
    batcher: Batcher | None = None,
) -> Run:
    """Greedy answers to every prompt, all admitted at once and decoded together."""
    batcher = batcher or Batcher(engine, _Collect())
    answers = [Answer() for _ in prompts]
    params = SamplingParams(max_tokens=max_tokens)
    for prompt, answer in zip(prompts, answers, strict=True):
        run = RequestRun(
            engine,
            prompt,
            params,
            stop_token_ids=stop_token_ids,
            speculate=speculate,
            costs=batcher.costs,
        )
        batcher.add(Member(run, tag=answer))
    passes, rows = batcher.stats.passes, batcher.stats.decode_rows
    store = engine.experts
    store.take_usage()  # starts the feed: every step's selections from now on
    trace: list = []
    t0 = time.perf_counter()
    decoding: tuple[float, int, int] | None = None  # (time, tokens, bytes) when prompts end
    while batcher.members:
        batcher.step()
        routing = take_pass(store)
        if decoding is not None:
            trace.append(routing)
        elif all(a.tokens or a.finish or a.error for a in answers):
            decoding = (time.perf_counter(), _generated(answers), store.stats.bytes_read)
    wall = time.perf_counter() - t0
    failed = [a.error for a in answers if a.error]
    if failed:
        raise ColibriError(f"a benchmark request failed: {failed[0]}")
    end = time.perf_counter()
    start, first_tokens, first_bytes = decoding or (end, _generated(answers), 0)
    return Run(
        answers,
        wall,
        _generated(answers),
        batcher.stats.passes - passes,
        batcher.stats.decode_rows - rows,
        end - start,
        _generated(answers) - first_tokens,
        store.stats.bytes_read - first_bytes,
        trace,
    )


def _generated(answers: Sequence[Answer]) -> int:
    return sum(len(a.tokens) for a in answers)


def new_batcher(engine: Engine) -> Batcher:
    return Batcher(engine, _Collect())


def flush_cache(store: Any) -> None:
    """Empty the expert cache (the pins stay), so no run starts warmer than another."""
    keep = store.cache_per_layer
    store.set_cache_per_layer(0)
    store.set_cache_per_layer(keep)
