"""The generation loop: prefill the prompt, then sample and decode one token at a time.

`generate` is a plain iterator of events so every front end (one-shot CLI, socket
server, HTTP) drives it the same way and decides itself how to print or frame text.
It owns the rules that must not differ between front ends: context limits, stop tokens,
stop strings across token boundaries, cancellation and the statistics.

Context rule: a prompt that does not leave room for one generated token is refused with
the numbers (never truncated silently); otherwise `max_tokens` is clamped to the room
left, and hitting that limit finishes with "length" like any other token limit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from colibrid.engine.batch import LOGITS_ALL, LOGITS_LAST, Forward
from colibrid.engine.constraint import Constraint, ConstraintStats
from colibrid.engine.mtp_draft import MTPDrafter
from colibrid.engine.sampling import Sampler, SamplingParams, check_logits
from colibrid.engine.speculate import (
    OFF,
    PassCosts,
    PromptLookup,
    SpecSettings,
    SpecStats,
    Speculation,
)
from colibrid.engine.tokenizer import StreamingDetokenizer
from colibrid.errors import Cancelled, RequestError


class SessionLike(Protocol):
    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        all_logits: bool = False,
        cancel: threading.Event | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> np.ndarray: ...
    def decode(self, token_id: int, *, cancel: threading.Event | None = None) -> np.ndarray: ...
    def common_prefix(self, token_ids: Sequence[int]) -> int: ...
    def truncate(self, length: int) -> None: ...
    def remember_logits(self, length: int, logits: np.ndarray) -> None: ...
    def logits_at(self, length: int) -> np.ndarray | None: ...


class EngineLike(Protocol):
    """What generation needs of `colibrid.engine.engine.Engine`."""

    max_context: int
    vocab_size: int

    def new_session(self) -> SessionLike: ...


@dataclass(frozen=True)
class GenStats:
    """Counts and timings of one generation.

    generated_tokens counts every sampled token, a stop token included. The first token
    comes from the prefill logits, so decode_tok_s is over generated_tokens - 1 steps.
    prefill_tok_s is over the prompt tokens actually computed (not those reused from kept
    KV), 0.0 when none were.
    """

    prompt_tokens: int
    generated_tokens: int
    prefill_s: float
    decode_s: float
    prefill_tok_s: float
    decode_tok_s: float

    @classmethod
    def measure(
        cls,
        prompt: int,
        generated: int,
        prefill_s: float,
        decode_s: float,
        computed: int | None = None,
    ) -> GenStats:
        steps = max(generated - 1, 0)
        computed = prompt if computed is None else computed
        return cls(
            prompt_tokens=prompt,
            generated_tokens=generated,
            prefill_s=prefill_s,
            decode_s=decode_s,
            prefill_tok_s=computed / prefill_s if computed and prefill_s > 0 else 0.0,
            decode_tok_s=steps / decode_s if decode_s > 0 else 0.0,
        )

    def as_line(self, *, verbose: bool = False) -> str:
        line = (
            f"{self.prompt_tokens} prompt + {self.generated_tokens} generated tokens, "
            f"prefill {self.prefill_tok_s:.1f} tok/s, decode {self.decode_tok_s:.1f} tok/s"
        )
        if verbose:
            line += f" (prefill {self.prefill_s:.3f} s, decode {self.decode_s:.3f} s)"
        return line


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it releases ("" while text is held back)."""

    token_id: int
    text: str


@dataclass(frozen=True)
class DoneEvent:
    """The end: finish_reason is "stop", "length" or "cancelled". With a grammar,
    "stop" means the grammar accepts the text; "length" means it was cut short."""

    finish_reason: str
    stats: GenStats
    stop_string: str | None = None  # the stop string that ended the answer, if one did
    spec: SpecStats | None = None  # what speculation did, when it was on
    constraint: ConstraintStats | None = None  # what the grammar's masks cost, when one ran


GenEvent = TokenEvent | DoneEvent


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back what could start one.

    Text is released only once no stop string can begin in it, so a stop string split
    over several tokens is still caught and nothing of it is ever emitted. The stop string
    that completes first wins (on a tie, the one that starts first), so the result does
    not depend on how the text was split into tokens.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""
        self.matched: str | None = None  # the stop string found, once one is

    def feed(self, text: str, *, final: bool = False) -> tuple[str, bool]:
        """Returns (text to release, whether a stop string was found)."""
        buf = self._held + text
        hits = [(i + len(s), i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            self._held = ""
            _, start, self.matched = min(hits)
            return buf[:start], True
        keep = 0 if final else self._longest_stop_prefix_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best


def _check_prompt(engine: EngineLike, prompt_ids: Sequence[int]) -> list[int]:
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise RequestError("empty prompt: nothing to generate from")
    bad = next((t for t in ids if not 0 <= t < engine.vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary (0..{engine.vocab_size - 1})")
    if len(ids) >= engine.max_context:
        raise RequestError(
            f"prompt has {len(ids)} tokens but the context holds {engine.max_context}; "
            "it must leave room for at least one generated token"
        )
    return ids


def generate(
    engine: EngineLike,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    stop_token_ids: frozenset[int] = frozenset(),
    detokenizer: StreamingDetokenizer | None = None,
    cancel: threading.Event | None = None,
    session: SessionLike | None = None,
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
    Bad requests raise RequestError from this call itself, before any engine work.

    This drives `generation` alone, one pass at a time; the daemon drives many together.
    """
    steps = generation(
        engine,
        prompt_ids,
        params,
        stop_token_ids=stop_token_ids,
        detokenizer=detokenizer,
        cancel=cancel,
        session=session,
        speculate=speculate,
        constraint=constraint,
    )
    return _drive_alone(engine, steps, cancel, progress)


def _drive_alone(
    engine: EngineLike,
    steps: Generation,
    cancel: threading.Event | None,
    progress: Callable[[int, int], None] | None,
) -> Iterator[GenEvent]:
    """Run each pass `steps` asks for as the session's own prefill."""
    reply: Any = None
    failure: BaseException | None = None
    while True:
        try:
            item = steps.throw(failure) if failure is not None else steps.send(reply)
        except StopIteration:
            return
        reply = failure = None
        if not isinstance(item, Forward):
            yield item
            continue
        one = item.logits == LOGITS_LAST and len(item.tokens) == 1
        t0 = time.perf_counter()
        try:
            if one:
                reply = item.session.decode(int(item.tokens[0]), cancel=cancel)
            else:
                reply = item.session.prefill(
                    item.tokens,
                    all_logits=item.logits == LOGITS_ALL,
                    cancel=cancel,
                    progress=progress if item.is_prompt else None,
                )
        except Cancelled as exc:
            failure = exc
        else:
            steps.costs.observe(len(item.tokens), time.perf_counter() - t0)


class Generation:
    """A request's generation as a coroutine (see `generation`): `send` the logits of the
    pass it asked for, `throw` `Cancelled` when that pass was abandoned. `costs` prices its
    speculation depth and is fed by whoever runs its passes."""

    def __init__(self, gen: Generator[GenEvent | Forward, Any, None], costs: PassCosts) -> None:
        self._gen = gen
        self.costs = costs

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> GenEvent | Forward:
        return self._gen.send(None)

    def send(self, value: Any) -> GenEvent | Forward:
        return self._gen.send(value)

    def throw(self, exc: BaseException) -> GenEvent | Forward:
        return self._gen.throw(exc)

    def close(self) -> None:
        self._gen.close()


def generation(
    engine: EngineLike,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    stop_token_ids: frozenset[int] = frozenset(),
    detokenizer: StreamingDetokenizer | None = None,
    cancel: threading.Event | None = None,
    session: SessionLike | None = None,
    speculate: SpecSettings = OFF,
    costs: PassCosts | None = None,
    constraint: Constraint | None = None,
) -> Generation:
    """`generate` as a coroutine that does not run the model itself: it yields a `Forward`
    (engine.batch) whenever it needs a pass, and is sent that pass's logits back (or is
    thrown `Cancelled` when the pass was abandoned), so a driver can run the passes of
    many requests as one. Yields the same events, in the same order, as `generate`.
    `costs` (engine-wide pass times, which the driver feeds) prices speculation;
    `constraint` (one per request: it holds the grammar's state) masks its tokens."""
    ids = _check_prompt(engine, prompt_ids)
    if params.stop and detokenizer is None:
        raise RequestError("stop strings need a tokenizer to see the text")
    budget = min(params.max_tokens, engine.max_context - len(ids))
    costs = costs or PassCosts()
    gen = _run(
        engine,
        ids,
        budget,
        Sampler(params),
        stop_token_ids,
        detokenizer,
        StopStringMatcher(params.stop),
        cancel,
        session,
        lambda s: make_speculation(engine, speculate, costs, s),
        constraint,
    )
    return Generation(gen, costs)


def make_speculation(
    engine: EngineLike, settings: SpecSettings, costs: PassCosts, session: SessionLike
) -> Speculation | None:
    """The request's speculation: the MTP layer drafts for `mtp` and `auto` where the
    engine runs it, prompt lookup otherwise."""
    if not settings.on:
        return None
    if settings.mode in ("mtp", "auto") and getattr(engine, "mtp_on", False):
        return Speculation(settings, MTPDrafter(engine, session), costs)
    return Speculation(settings, PromptLookup(), costs)


def reusable_prefix(session: SessionLike, ids: Sequence[int]) -> int:
    """How many leading tokens of the prompt `ids` need no prefill in `session`: the
    common prefix, less the last prompt token unless the logits after the whole prompt
    are remembered (a repeated prompt)."""
    held = session.common_prefix(ids)
    if held == len(ids) and session.logits_at(held) is not None:
        return held
    return min(held, len(ids) - 1)


def _run(
    engine: EngineLike,
    ids: list[int],
    budget: int,
    sampler: Sampler,
    stop_token_ids: frozenset[int],
    detok: StreamingDetokenizer | None,
    matcher: StopStringMatcher,
    cancel: threading.Event | None,
    session: SessionLike | None,
    speculation: Callable[[SessionLike], Speculation | None],
    constraint: Constraint | None,
) -> Generator[GenEvent | Forward, Any, None]:
    generated, prefill_s, decode_s, reuse = 0, 0.0, 0.0, 0
    spec: Speculation | None = None

    def done(reason: str) -> DoneEvent:
        engine.request_finished()  # the store saves its profile and re-pins
        stats = GenStats.measure(len(ids), generated, prefill_s, decode_s, len(ids) - reuse)
        return DoneEvent(
            reason,
            stats,
            matcher.matched,
            spec.stats if spec else None,
            constraint.stats() if constraint else None,
        )

    if cancel is not None and cancel.is_set():
        yield done("cancelled")
        return
    if session is None:
        session = engine.new_session()
    spec = speculation(session)
    reuse = reusable_prefix(session, ids)
    session.truncate(reuse)
    t0 = time.perf_counter()
    if reuse == len(ids):  # the same prompt again: its logits are remembered
        logits = session.logits_at(reuse)
        assert logits is not None
    else:
        try:
            logits = yield Forward(session, _rows(ids[reuse:]))
        except Cancelled:
            yield done("cancelled")
            return
        session.remember_logits(len(ids), logits)
    prefill_s = time.perf_counter() - t0
    if spec is not None:
        spec.feed(ids)
    rows = [logits]  # logits to sample from in turn: the pass's rows whose input holds
    drafts: list[int] = []  # the tokens the pass assumed follow rows[0], rows[1], ...
    booked = spec  # whose drafts the pass verified (None: the grammar's forced tokens)
    seconds = 0.0  # the pass's time (0 for the prompt's: not a decode step)
    while True:
        held = session.length  # rows held after the pass (its first input included)
        for k, row in enumerate(rows):
            check_logits(row, generated)  # the model's own output: NaN/inf fail the request
            # each row masked with the grammar's state after the tokens before it
            token = sampler.sample(row if constraint is None else constraint.apply(row))
            generated += 1
            is_stop_token = token in stop_token_ids
            complete = False  # the grammar is done: only a stop token could follow
            if constraint is not None and not is_stop_token:
                constraint.advance(token)
                complete = constraint.complete
            last = is_stop_token or complete or generated >= budget
            piece = "" if detok is None or is_stop_token else detok.push(token)
            if last and detok is not None:
                piece += detok.flush()
            text, hit = matcher.feed(piece, final=last)
            if spec is not None:
                spec.feed([token])
            matched = k < len(drafts) and drafts[k] == token
            going_on = matched and not (hit or last)
            if not going_on:  # rows past this token's input assumed other tokens
                session.truncate(held - len(rows) + k + 1)
                _account(booked, drafts, k + matched, k + 1, seconds)
            yield TokenEvent(token, text)
            if hit or is_stop_token or complete:
                yield done("stop")
                return
            if last:
                yield done("length")
                return
            if cancel is not None and cancel.is_set():
                if going_on:
                    session.truncate(held - len(rows) + k + 1)
                    _account(booked, drafts, k + 1, k + 1, seconds)
                yield done("cancelled")
                return
            if not going_on:
                break
        drafts, booked = _drafts(spec, constraint, budget - generated - 1)
        t0 = time.perf_counter()
        mode = LOGITS_ALL if drafts else LOGITS_LAST
        try:
            out = yield Forward(session, _rows([token, *drafts]), mode)
        except Cancelled:
            yield done("cancelled")
            return
        seconds = time.perf_counter() - t0
        decode_s += seconds
        rows = list(out) if drafts else [out]


def _drafts(
    spec: Speculation | None, constraint: Constraint | None, limit: int
) -> tuple[list[int], Speculation | None]:
    """The tokens the next pass verifies after the last one, and who proposed them. The
    grammar's forced tokens first (the `"name": "` of a JSON object: a pass checks them
    all, and they are kept unless the model would split the text into other tokens),
    else the drafter's, less any the grammar refuses. Verifying changes no token."""
    if constraint is not None:
        forced = constraint.forced(limit)
        if forced:
            return forced, None
    drafts = spec.plan(limit) if spec is not None else []
    if drafts and constraint is not None:
        drafts = constraint.drafts(drafts)  # one the grammar refuses is never kept
    return drafts, spec


def _rows(ids: Sequence[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64)


def _account(
    spec: Speculation | None, drafts: list[int], accepted: int, emitted: int, seconds: float
) -> None:
    """Book the pass whose rows were just sampled (nothing for the prompt's)."""
    if spec is None or seconds <= 0:
        return
    if drafts:
        spec.verified(len(drafts), accepted, emitted, seconds)
    else:
        spec.plain(seconds)


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
