"""Log-probabilities of a sampled token and its best alternatives (OpenAI's `logprobs`).

Which distribution: the log-softmax of the logits the sampler starts from, that is the
model's logits after the grammar's mask and the repetition penalties, at temperature 1
and before the top-k / top-p / min-p filters. Why that one: it is the model's own
distribution as the request shaped it (a grammar or a penalty changes what the model may
say), but not the sampling knobs (temperature 0 would make every logprob 0 or -inf and
say nothing; a filter would make them depend on how the dice were set). OpenAI and
llama-server report the same for a request without a grammar or penalties.

A token the grammar forbids has logprob -inf: it is never listed as an alternative (JSON
has no -inf), so fewer than k alternatives come back when fewer are allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on `top_logprobs`


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's logprob and the `top` best tokens (id, logprob), best first,
    ties to the lower id (the sampler's own order)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of each row of logits (-inf stays -inf); `colibri eval`
    scores whole sequences with it too."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, token: int, k: int) -> TokenLogprobs:
    """`token`'s logprob under `logits` and the `k` most likely tokens (finite ones)."""
    lp = log_softmax(logits)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, lp.size)
        candidates = np.argpartition(-lp, k - 1)[:k] if k < lp.size else np.arange(lp.size)
        # the k-th value may tie with others outside `candidates`: take every tie, then order
        threshold = lp[candidates].min()
        tied = np.flatnonzero(lp >= threshold)
        order = tied[np.argsort(-lp[tied], kind="stable")][:k]
        top = tuple((int(i), float(lp[i])) for i in order if np.isfinite(lp[i]))
    return TokenLogprobs(int(token), float(lp[token]), top)
