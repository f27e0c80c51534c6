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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from colibrid.engine.sampling import Sampler, SamplingParams
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
    """The end: finish_reason is "stop", "length" or "cancelled"."""

    finish_reason: str
    stats: GenStats
    stop_string: str | None = None  # the stop string that ended the answer, if one did


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
) -> Iterator[GenEvent]:
    """Yield a TokenEvent per generated token, then one DoneEvent.

    With `session` (a conversation kept by the caller), the KV cache of the longest common
    prefix of its tokens and the prompt is reused and only the rest is prefilled; a prompt
    the session has seen whole is answered from the logits remembered then, so a repeated
    request (same seed) repeats its answer exactly.

    A stop token ends generation; it gets a TokenEvent whose text is only what was still
    held back (never the stop token's own text). Text cut by a stop string stops at the
    string. `cancel` is checked before the prefill and between tokens; text held back at
    that moment (part of a character or a possible stop-string start) is dropped.
    `progress(layers_done, layers)` follows the prompt's prefill (see Session.prefill).
    Bad requests raise RequestError from this call itself, before any engine work.
    """
    ids = _check_prompt(engine, prompt_ids)
    if params.stop and detokenizer is None:
        raise RequestError("stop strings need a tokenizer to see the text")
    budget = min(params.max_tokens, engine.max_context - len(ids))
    sampler = Sampler(params)
    matcher = StopStringMatcher(params.stop)
    return _run(
        engine,
        ids,
        budget,
        sampler,
        stop_token_ids,
        detokenizer,
        matcher,
        cancel,
        session,
        progress,
    )


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
    progress: Callable[[int, int], None] | None = None,
) -> Iterator[GenEvent]:
    generated, prefill_s, decode_s, reuse = 0, 0.0, 0.0, 0

    def done(reason: str) -> DoneEvent:
        engine.request_finished()  # the store saves its profile and re-pins
        stats = GenStats.measure(len(ids), generated, prefill_s, decode_s, len(ids) - reuse)
        return DoneEvent(reason, stats, matcher.matched)

    if cancel is not None and cancel.is_set():
        yield done("cancelled")
        return
    if session is None:
        session = engine.new_session()
    reuse = reusable_prefix(session, ids)
    session.truncate(reuse)
    t0 = time.perf_counter()
    if reuse == len(ids):  # the same prompt again: its logits are remembered
        logits = session.logits_at(reuse)
        assert logits is not None
    else:
        try:
            logits = session.prefill(ids[reuse:], cancel=cancel, progress=progress)
        except Cancelled:
            yield done("cancelled")
            return
        session.remember_logits(len(ids), logits)
    prefill_s = time.perf_counter() - t0
    while True:
        token = sampler.sample(logits)
        generated += 1
        is_stop_token = token in stop_token_ids
        last = is_stop_token or generated >= budget
        piece = "" if detok is None or is_stop_token else detok.push(token)
        if last and detok is not None:
            piece += detok.flush()
        text, hit = matcher.feed(piece, final=last)
        yield TokenEvent(token, text)
        if hit or is_stop_token:
            yield done("stop")
            return
        if last:
            yield done("length")
            return
        if cancel is not None and cancel.is_set():
            yield done("cancelled")
            return
        t0 = time.perf_counter()
        try:
            logits = session.decode(token, cancel=cancel)
        except Cancelled:
            yield done("cancelled")
            return
        decode_s += time.perf_counter() - t0


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
