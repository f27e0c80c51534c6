"""Choosing the next token from logits: validated parameters and a seeded sampler.

Every request owns its random generator (never a global seed), so the same seed and the
same logits always give the same tokens, whatever else the process is doing. The
arithmetic is float64 with a fixed tie order (lower token index first), so the result
does not depend on how numpy happens to sort.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from colibrid.engine.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs, token_logprobs
from colibrid.engine.penalties import Repetition
from colibrid.errors import ColibriError, RequestError

MAX_STOP_STRINGS = 16
MAX_SEED = 2**64


class SamplingError(ColibriError):
    """The model produced logits nothing sensible can be sampled from (NaN, +inf)."""

    code = "BAD_LOGITS"


class NonFiniteLogits(SamplingError):
    """The model's own logits for a position hold NaN or inf: its arithmetic went wrong
    (overflowing activations, damaged weights), so no token is sampled from them and the
    request fails. The SERVE protocol lists no code of its own for this: INTERNAL, with a
    message that says what happened."""

    code = "INTERNAL"


def check_logits(row: np.ndarray, position: int) -> None:
    """Refuse a model output row holding NaN or +-inf before any mask or sampler sees it
    (a grammar's mask could hide a NaN behind -inf, argmax would take the first NaN).
    ``position``: the index of the token this row would have chosen, for the message."""
    if np.isfinite(row).all():
        return
    nan = int(np.isnan(row).sum())
    inf = int(row.size - nan - np.isfinite(row).sum())
    raise NonFiniteLogits(
        f"the model produced non-finite logits for generated token {position} ({nan} NaN "
        f"and {inf} inf of {row.size}); no token was sampled from them. Damaged weights do "
        "this: `colibri inspect --verify MODEL` checks them"
    )


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens; checked once, at construction.

    temperature 0 (the default) is greedy decoding: the one-shot CLI and the oracle tests
    want a reproducible answer unless asked otherwise. top_k 0 and top_p 1 switch those
    filters off. seed None draws a seed from the OS. `stop` strings end generation when
    they appear in the text (they are not part of the output).

    Repetition control (engine.penalties): `repeat_penalty` (1 = off) over the last
    `repeat_last_n` context tokens (0 = off, -1 = the whole context), and
    `frequency_penalty` / `presence_penalty` (0 = off) on the tokens generated so far.
    `min_p` (0 = off) drops the tokens less likely than min_p times the most likely one.
    Everything is off by default: the engine and the APIs keep the defaults their APIs
    define; the chat commands choose their own (colibri_cli). `logprobs` None reports
    nothing; k in 0..20 reports each token's logprob and its k best alternatives
    (engine.logprobs).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not (0.0 <= self.temperature < math.inf):
            raise RequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise RequestError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        stop = self.stop
        if isinstance(stop, str) or not isinstance(stop, (tuple, list)):
            raise RequestError("stop must be a list of strings")
        if len(stop) > MAX_STOP_STRINGS:
            raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        if not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop strings must be non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        self._check_repetition()
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise RequestError(
                f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (the alternatives "
                f"reported per token), got {self.logprobs!r}"
            )
        for name in ("repeat_penalty", "frequency_penalty", "presence_penalty", "min_p"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    def _check_repetition(self) -> None:
        penalty = self.repeat_penalty
        if not _is_real(penalty) or not 0.0 < penalty < math.inf:
            raise RequestError(
                f"repeat_penalty must be a finite number > 0 (1 = off), got {penalty!r}"
            )
        if not _is_int(self.repeat_last_n) or self.repeat_last_n < -1:
            raise RequestError(
                "repeat_last_n must be an integer >= -1 (0 = off, -1 = the whole context), "
                f"got {self.repeat_last_n!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise RequestError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _ranked(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values of x, descending, ties broken by lower index."""
    if k < x.size:
        threshold = np.partition(x, x.size - k)[x.size - k]
        candidates = np.flatnonzero(x >= threshold)  # ascending index: >= k of them
    else:
        candidates = np.arange(x.size)
    order = np.argsort(-x[candidates], kind="stable")
    return candidates[order[:k]]


@dataclass(frozen=True)
class Draw:
    """A sampled token, and its logprobs when the request asked for them."""

    token: int
    logprobs: TokenLogprobs | None = None


class Sampler:
    """Per-request sampler: `draw(logits)` chooses the next token (and reports its
    logprobs when asked); every token it chooses becomes part of the history the
    repetition penalties see. `context`: the prompt's ids, the start of that history."""

    def __init__(self, params: SamplingParams, context: Sequence[int] = ()) -> None:
        self.params = params
        self._rng = np.random.Generator(np.random.PCG64(params.seed))
        self.repetition = Repetition(params, context)

    def sample(self, logits: np.ndarray) -> int:
        return self.draw(logits).token

    def draw(self, logits: np.ndarray) -> Draw:
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.size == 0:
            raise SamplingError(f"expected logits of shape [V], got {logits.shape}")
        # -inf is a legitimate mask (at least one finite logit must remain); NaN/+inf are not.
        if np.isnan(logits).any() or np.isposinf(logits).any() or not np.isfinite(logits).any():
            raise SamplingError("model produced non-finite logits")
        if self.repetition.on:
            logits = self.repetition.apply(logits)
        token = self._choose(logits)
        self.repetition.accept(token)
        k = self.params.logprobs
        return Draw(token, None if k is None else token_logprobs(logits, token, k))

    def _choose(self, logits: np.ndarray) -> int:
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))  # first maximum: ties go to the lowest index
        x = logits.astype(np.float64)
        # Subtract the max before dividing so a tiny temperature cannot overflow to inf.
        with np.errstate(over="ignore"):  # overflow to -inf is the right limit here
            x = (x - x.max()) / p.temperature
        k = p.top_k if 0 < p.top_k < x.size else x.size
        idx = _ranked(x, k)
        probs = np.exp(x[idx])
        probs /= probs.sum()
        if p.top_p < 1.0:
            cum = np.cumsum(probs)
            keep = min(int(np.searchsorted(cum, p.top_p, side="left")) + 1, idx.size)
            idx, probs = idx[:keep], probs[:keep]
        if p.min_p > 0.0:  # on the tempered distribution, as transformers and vLLM do
            keep = int(np.count_nonzero(probs >= p.min_p * probs[0]))  # probs descend
            idx, probs = idx[:keep], probs[:keep]
        cum = np.cumsum(probs)
        u = self._rng.random() * cum[-1]
        pick = min(int(np.searchsorted(cum, u, side="right")), idx.size - 1)
        return int(idx[pick])
