"""One request alone: `generate` drives a `RequestRun` (engine.request_run) through its
passes, each as the session's own prefill or decode, and yields its events. The one-shot
CLI, the benches and the tests use it; the daemon's batcher drives many requests in
shared passes instead, with the same `RequestRun`.

`generate` is a plain iterator of events (engine.events) so every front end decides
itself how to print or frame text.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from colibrid.engine.batch import LOGITS_ALL, LOGITS_LAST, Forward
from colibrid.engine.constraint import Constraint
from colibrid.engine.events import DoneEvent, GenEvent, GenStats, TokenEvent
from colibrid.engine.protocols import EngineLike
from colibrid.engine.request_run import RequestRun, reusable_prefix
from colibrid.engine.sampling import SamplingParams
from colibrid.engine.speculate import OFF, SpecSettings
from colibrid.engine.tokenizer import StreamingDetokenizer
from colibrid.errors import Cancelled, RequestError

__all__ = [
    "DoneEvent",
    "GenEvent",
    "GenStats",
    "TokenEvent",
    "generate",
    "reusable_prefix",
    "teacher_forced_argmax",
]


def generate(
    engine: EngineLike,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    stop_token_ids: frozenset[int] = frozenset(),
    detokenizer: StreamingDetokenizer | None = None,
    cancel: threading.Event | None = None,
    session: object | None = None,
    progress: Callable[[int, int], None] | None = None,
    speculate: SpecSettings = OFF,
    constraint: Constraint | None = None,
) -> Iterator[GenEvent]:
    """Yield a TokenEvent per generated token, then one DoneEvent.

    With `session` (a conversation kept by the caller), the KV cache of the longest common
    prefix of its tokens and the prompt is reused and only the rest is prefilled; a prompt
    the session has seen whole is answered from the logits remembered then, so a repeated
    request (same seed) repeats its answer exactly.

    A stop token ends generation; it gets a TokenEvent whose text is only what was still
    held back (never the stop token's own text). Text cut by a stop string stops at the
    string. `cancel` is checked before the prefill, between layers and between tokens;
    text held back at that moment (part of a character or a possible stop-string start)
    is dropped. `progress(layers_done, layers)` follows the prompt's prefill (see
    Session.prefill). `speculate` drafts tokens and verifies them several at a time
    (engine.speculate): the same tokens, sooner. `constraint` masks every token to a
    grammar (engine.constraint): the answer ends "stop" once the grammar is complete.
    Bad requests raise RequestError from this call itself, before any engine work. When
    the request ends, the engine is told (`Engine.request_finished`)."""
    run = RequestRun(
        engine,
        prompt_ids,
        params,
        stop_token_ids=stop_token_ids,
        detokenizer=detokenizer,
        cancel=cancel,
        session=session,  # type: ignore[arg-type]
        speculate=speculate,
        constraint=constraint,
    )
    return _alone(engine, run, cancel, progress)


def _alone(
    engine: EngineLike,
    run: RequestRun,
    cancel: threading.Event | None,
    progress: Callable[[int, int], None] | None,
) -> Iterator[GenEvent]:
    """Run each pass `run` asks for as the session's own prefill or decode."""
    try:
        yield from run.begin()
        while (forward := run.next_pass()) is not None:
            t0 = time.perf_counter()
            try:
                out = _pass(forward, cancel, progress)
            except Cancelled:
                yield run.abandon()
                return
            run.costs.observe(len(forward.tokens), time.perf_counter() - t0)
            yield from run.take(out)
    finally:
        engine.request_finished()  # the store saves its profile and re-pins


def _pass(
    forward: Forward,
    cancel: threading.Event | None,
    progress: Callable[[int, int], None] | None,
) -> np.ndarray:
    session = forward.session
    if forward.logits == LOGITS_LAST and len(forward.tokens) == 1:
        return session.decode(int(forward.tokens[0]), cancel=cancel)
    return session.prefill(
        forward.tokens,
        all_logits=forward.logits == LOGITS_ALL,
        cancel=cancel,
        progress=progress if forward.is_prompt else None,
    )


def teacher_forced_argmax(engine: EngineLike, ids: Sequence[int]) -> list[int]:
    """Greedy next-token prediction at every position of `ids` in one prefill (oracle tests)."""
    ids = [int(t) for t in ids]
    if not ids:
        raise RequestError("empty prompt: nothing to generate from")
    if len(ids) > engine.max_context:
        raise RequestError(f"{len(ids)} tokens exceed the context of {engine.max_context}")
    logits = np.asarray(engine.new_session().prefill(ids, all_logits=True))
    if logits.shape[0] != len(ids):
        raise RuntimeError(f"engine returned {logits.shape[0]} rows of logits for {len(ids)} ids")
    return [int(t) for t in np.argmax(logits, axis=-1)]
