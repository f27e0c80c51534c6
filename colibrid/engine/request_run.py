"""One tokenised request on the engine: what it asks to compute next, and what it makes of
the logits it gets back.

A `RequestRun` holds everything of a request that must not differ between drivers (the
one-shot CLI runs one, the daemon's batcher many in shared passes): the context rule, the
sampler, the text it releases (detokeniser and stop strings, `TextOut`), the grammar's
constraint, speculation and its accounting, cancellation and the statistics. It never
runs the model: `begin` starts it, `next_pass` says which rows it needs computed,
`take` is given that pass's logits and returns the events they made (the tokens, and the
end once there is one), `abandon` ends it when a pass of it was given up. Nothing here
touches the expert store: the driver that owns a request's boundaries ends it there
(`Engine.request_finished`: the usage profile saved, REPIN).

Context rule: a prompt that does not leave room for one generated token is refused with
the numbers (never truncated silently); otherwise `max_tokens` is clamped to the room
left, and hitting that limit finishes with "length" like any other token limit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from colibrid.engine.batch import LOGITS_ALL, LOGITS_LAST, Forward
from colibrid.engine.constraint import Constraint
from colibrid.engine.events import DoneEvent, GenEvent, GenStats, TokenEvent
from colibrid.engine.mtp_draft import MTPDrafter
from colibrid.engine.protocols import EngineLike, SessionLike
from colibrid.engine.sampling import Sampler, SamplingParams, check_logits
from colibrid.engine.speculate import (
    OFF,
    PassCosts,
    PromptLookup,
    SpecSettings,
    Speculation,
)
from colibrid.engine.text_out import TextOut
from colibrid.engine.tokenizer import StreamingDetokenizer
from colibrid.errors import RequestError


def check_prompt(engine: EngineLike, prompt_ids: Sequence[int]) -> list[int]:
    """The prompt as ints, refused (RequestError) when empty, outside the vocabulary, or
    leaving no room in the context for a generated token."""
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


def reusable_prefix(session: SessionLike, ids: Sequence[int]) -> int:
    """How many leading tokens of the prompt `ids` need no prefill in `session`: the
    common prefix, less the last prompt token unless the logits after the whole prompt
    are remembered (a repeated prompt)."""
    held = session.common_prefix(ids)
    if held == len(ids) and session.logits_at(held) is not None:
        return held
    return min(held, len(ids) - 1)


def make_speculation(
    engine: EngineLike, settings: SpecSettings, costs: PassCosts, session: SessionLike
) -> Speculation | None:
    """The request's speculation: the MTP layer drafts for `mtp` and `auto` where the
    engine runs it, prompt lookup otherwise."""
    if not settings.on:
        return None
    if settings.mode in ("mtp", "auto") and engine.mtp_on:
        return Speculation(settings, MTPDrafter(engine, session), costs)
    return Speculation(settings, PromptLookup(), costs)


@dataclass
class _Pass:
    """The pass a request waits for: its rows, and for a verify the drafts it assumed and
    who proposed them (None: the grammar's forced tokens)."""

    forward: Forward
    drafts: list[int]
    booked: Speculation | None
    started: float
    prompt: bool = False  # the prompt's prefill (its logits start the answer)


@dataclass(frozen=True)
class _Sampled:
    """One token taken from one row of logits, and what it decided."""

    event: TokenEvent
    finish: str | None  # "stop" or "length" when the answer ends with it
    going_on: bool  # the next row's input is this token: keep sampling the pass's rows


class RequestRun:
    """One request's generation: see the module doc. `costs` (engine-wide pass times,
    which the driver feeds) prices speculation; `constraint` (one per request: it holds
    the grammar's state) masks its tokens. Bad requests raise RequestError here, before
    any engine work."""

    def __init__(
        self,
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
    ) -> None:
        self.ids = check_prompt(engine, prompt_ids)
        if params.stop and detokenizer is None:
            raise RequestError("stop strings need a tokenizer to see the text")
        self.engine = engine
        self.budget = min(params.max_tokens, engine.max_context - len(self.ids))
        self.costs = costs or PassCosts()
        self.sampler = Sampler(params, self.ids)  # the prompt starts the penalties' history
        self.text = TextOut(detokenizer, params.stop)
        self.stops = stop_token_ids
        self.cancel_flag = cancel
        self.session = session
        self.speculate = speculate
        self.constraint = constraint
        self.spec: Speculation | None = None
        self.generated = 0
        self.reuse = 0
        self.prefill_s = self.decode_s = 0.0
        self.result: DoneEvent | None = None
        self._pending: _Pass | None = None
        self._began = 0.0

    # ---- what a driver calls ---------------------------------------------------------
    def begin(self) -> Iterator[GenEvent]:
        """Start: the prompt's pass is asked for, or (a prompt this session answered
        before) its first tokens are taken from the logits remembered then. The events
        come as an iterator the driver runs to its end before asking `next_pass`."""
        if self._cancelled():
            return iter([self._finish("cancelled")])
        if self.session is None:
            self.session = self.engine.new_session()
        session = self.session
        self.spec = make_speculation(self.engine, self.speculate, self.costs, session)
        self.reuse = reusable_prefix(session, self.ids)
        session.truncate(self.reuse)
        self._began = time.perf_counter()
        if self.reuse < len(self.ids):
            forward = Forward(session, _rows(self.ids[self.reuse :]))
            self._pending = _Pass(forward, [], self.spec, self._began, prompt=True)
            return iter(())
        logits = session.logits_at(self.reuse)  # the same prompt again
        assert logits is not None
        return self._after_prompt(logits)

    def next_pass(self) -> Forward | None:
        """The rows this request needs computed next (None once it has ended)."""
        return None if self._pending is None else self._pending.forward

    def take(self, out: np.ndarray) -> Iterator[GenEvent]:
        """The logits of the pass `next_pass` asked for: the tokens they make, and the
        request's end when it comes; once the iterator is run to its end, the next pass
        is planned. A cancel set while a token's event is handled counts before the next
        token (the driver hands each event on as it comes)."""
        pending = self._pending
        assert pending is not None, "take() without a pass asked for"
        self._pending = None
        if pending.prompt:
            self.session.remember_logits(len(self.ids), out)
            return self._after_prompt(out)
        seconds = time.perf_counter() - pending.started
        self.decode_s += seconds
        rows = list(out) if pending.drafts else [out]
        return self._sample_rows(rows, pending.drafts, pending.booked, seconds)

    def abandon(self) -> DoneEvent:
        """The pass this request waited for was given up (a cancel): it ends "cancelled",
        its session holding what it held before that pass."""
        self._pending = None
        return self._finish("cancelled")

    @property
    def finished(self) -> bool:
        return self.result is not None

    # ---- inside ----------------------------------------------------------------------
    def _after_prompt(self, logits: np.ndarray) -> Iterator[GenEvent]:
        self.prefill_s = time.perf_counter() - self._began
        if self.spec is not None:
            self.spec.feed(self.ids)
        return self._sample_rows([logits], [], self.spec, 0.0)

    def _sample_rows(
        self,
        rows: list[np.ndarray],
        drafts: list[int],
        booked: Speculation | None,
        seconds: float,
    ) -> Iterator[GenEvent]:
        """Sample a pass's rows in turn, each from the state the tokens before it left
        (row k's input assumed ``drafts[k - 1]``; ``booked`` proposed them; the pass took
        ``seconds``, 0 for the prompt's); stop at the first whose token is not the input
        the next row assumed (the rows past it are dropped from the session)."""
        held = self.session.length  # rows held after the pass (its first input included)
        for k, row in enumerate(rows):
            sampled = self._sample(k, row, drafts)
            if not sampled.going_on:  # rows past this token's input assumed other tokens
                self.session.truncate(held - len(rows) + k + 1)
                matched = k < len(drafts) and drafts[k] == sampled.event.token_id
                _account(booked, drafts, k + matched, k + 1, seconds)
            yield sampled.event
            if sampled.finish is not None:
                yield self._finish(sampled.finish)
                return
            if self._cancelled():
                if sampled.going_on:
                    self.session.truncate(held - len(rows) + k + 1)
                    _account(booked, drafts, k + 1, k + 1, seconds)
                yield self._finish("cancelled")
                return
            if not sampled.going_on:
                break
        self._plan(sampled.event.token_id)

    def _sample(self, k: int, row: np.ndarray, drafts: list[int]) -> _Sampled:
        """Row ``k`` of a pass: its token, the text it releases, and whether the answer
        ends there or the next row (which assumed ``drafts[k]``) still holds."""
        check_logits(row, self.generated)  # the model's own output: NaN/inf fail it
        constraint = self.constraint
        draw = self.sampler.draw(row if constraint is None else constraint.apply(row))
        token = draw.token
        self.generated += 1
        is_stop = token in self.stops
        complete = False  # the grammar is done: only a stop token could follow
        if constraint is not None and not is_stop:
            constraint.advance(token)
            complete = constraint.complete
        last = is_stop or complete or self.generated >= self.budget
        text, hit = self.text.feed(token, is_stop=is_stop, last=last)
        if self.spec is not None:
            self.spec.feed([token])
        finish = "stop" if hit or is_stop or complete else "length" if last else None
        going_on = k < len(drafts) and drafts[k] == token and not (hit or last)
        return _Sampled(TokenEvent(token, text, draw.logprobs), finish, going_on)

    def _plan(self, token: int) -> None:
        """The next pass: the last token, and the drafts a verify checks after it."""
        drafts, booked = _drafts(self.spec, self.constraint, self.budget - self.generated - 1)
        mode = LOGITS_ALL if drafts else LOGITS_LAST
        forward = Forward(self.session, _rows([token, *drafts]), mode)
        self._pending = _Pass(forward, drafts, booked, time.perf_counter())

    def _cancelled(self) -> bool:
        return self.cancel_flag is not None and self.cancel_flag.is_set()

    def _finish(self, reason: str) -> DoneEvent:
        stats = GenStats.measure(
            len(self.ids),
            self.generated,
            self.prefill_s,
            self.decode_s,
            len(self.ids) - self.reuse,
        )
        self.result = DoneEvent(
            reason,
            stats,
            self.text.matched,
            self.spec.stats if self.spec else None,
            self.constraint.stats() if self.constraint else None,
        )
        return self.result


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
