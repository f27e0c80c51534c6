"""Choosing the next token from logits: validated parameters and a seeded sampler.

Every request owns its random generator (never a global seed), so the same seed and the
same logits always give the same tokens, whatever else the process is doing. The
arithmetic is float64 with a fixed tie order (lower token index first), so the result
does not depend on how numpy happens to sort.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

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
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()

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
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

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


class Sampler:
    """Per-request sampler: `sample(logits)` returns one token id."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.Generator(np.random.PCG64(params.seed))

    def sample(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.size == 0:
            raise SamplingError(f"expected logits of shape [V], got {logits.shape}")
        # -inf is a legitimate mask (at least one finite logit must remain); NaN/+inf are not.
        if np.isnan(logits).any() or np.isposinf(logits).any() or not np.isfinite(logits).any():
            raise SamplingError("model produced non-finite logits")
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
        cum = np.cumsum(probs)
        u = self._rng.random() * cum[-1]
        pick = min(int(np.searchsorted(cum, u, side="right")), idx.size - 1)
        return int(idx[pick])
