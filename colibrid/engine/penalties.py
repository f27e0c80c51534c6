"""Repetition control: the logits of tokens already seen made less likely, exactly.

Two families, with the names and semantics of the APIs that define them:

* `repeat_penalty` over the last `repeat_last_n` tokens (llama.cpp's and Ollama's): a token
  that occurs in that window has a positive logit divided by the penalty and a negative
  one multiplied by it (1.0 is off). The window is the last n tokens of the *context*,
  the prompt included, as llama.cpp counts it: a chat model repeating the user's words or
  its own previous turn is the loop it exists to break. `repeat_last_n` 0 switches it off,
  -1 looks at the whole context.
* `frequency_penalty` and `presence_penalty` (OpenAI's): ``logit -= count * frequency +
  (count > 0) * presence``, where count is how often the token was *generated* so far in
  this answer (OpenAI: "sampled prior to the current position"); the prompt is not
  counted, so a long system prompt does not silence the words the answer needs.

Why here, in the request's sampler state, and why it stays exact: the state is the
request's own tokens (its prompt and what it sampled), updated by the token sampled at
each row in turn. A speculative verify samples its rows in order and stops at the first
rejected draft, so row k sees the prompt, the accepted tokens and the drafts before it,
which are exactly the tokens plain decoding would have had; a batched pass gives every
request its own rows' logits. Same logits, same history, same arithmetic: same tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class RepetitionParams(Protocol):
    """The fields of `SamplingParams` this module reads."""

    repeat_penalty: float
    repeat_last_n: int
    frequency_penalty: float
    presence_penalty: float


class Repetition:
    """One request's repetition state: the window of recent context tokens (counted, so a
    step costs the number of distinct tokens in it, not the window's length) and how often
    each token was generated."""

    def __init__(self, params: RepetitionParams, context: Sequence[int] = ()) -> None:
        self.penalty = float(params.repeat_penalty)
        self.frequency = float(params.frequency_penalty)
        self.presence = float(params.presence_penalty)
        last_n = params.repeat_last_n if self.penalty != 1.0 else 0
        self._window: deque[int] | None = None
        self._in_window: dict[int, int] = {}
        if last_n != 0:
            self._window = deque(maxlen=None if last_n < 0 else last_n)
            for token in context:
                self._see(int(token))
        self._generated: dict[int, int] = {}

    @property
    def on(self) -> bool:
        return self._window is not None or self.frequency != 0.0 or self.presence != 0.0

    def _see(self, token: int) -> None:
        window = self._window
        assert window is not None
        if window.maxlen is not None and len(window) == window.maxlen:
            old = window.popleft()
            left = self._in_window[old] - 1
            if left:
                self._in_window[old] = left
            else:
                del self._in_window[old]
        window.append(token)
        self._in_window[token] = self._in_window.get(token, 0) + 1

    def accept(self, token: int) -> None:
        """`token` was generated: it enters the window and the counts."""
        if self._window is not None:
            self._see(token)
        if self.frequency != 0.0 or self.presence != 0.0:
            self._generated[token] = self._generated.get(token, 0) + 1

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """The penalised logits (a float32 copy; `logits` is left as it was). A masked
        token (-inf) stays masked whatever its penalty."""
        x = np.array(logits, dtype=np.float32, copy=True)
        if self._in_window:
            ids = np.fromiter(self._in_window, dtype=np.int64, count=len(self._in_window))
            ids = ids[ids < x.size]
            v = x[ids]
            x[ids] = np.where(v > 0, v / np.float32(self.penalty), v * np.float32(self.penalty))
        if self._generated:
            ids = np.fromiter(self._generated, dtype=np.int64, count=len(self._generated))
            counts = np.fromiter(self._generated.values(), dtype=np.float32, count=ids.size)
            keep = ids < x.size
            ids, counts = ids[keep], counts[keep]
            x[ids] -= counts * np.float32(self.frequency) + np.float32(self.presence)
        return x
