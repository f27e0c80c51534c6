"""Several sessions' new rows in one forward pass: batched decode and speculative verify.

Why: a decode step of a Mixture-of-Experts model reads every expert its rows choose. When
experts stream from disk, four requests decoding one after the other read four expert
sweeps per token; in one pass each layer fetches the union of their experts once. A
speculative verify is the same thing for one request: the last token and its drafts as
rows of one pass.

Why it changes no bit: every operation of the models computes a row alone (the kernels'
S rows equal S single-row calls, attention runs per sequence and per row over exactly the
keys the row can see, norms and the router are per row), so a request's logits are the
same whatever shares its pass, and a verified draft's logits are the ones a one-token
decode would have produced (`tests/engine/test_rows_independent.py` holds every
architecture to that, bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

LOGITS_LAST = "last"  # the logits after the last new row: [V]
LOGITS_ALL = "all"  # after every new row: [S, V] (a verify)
LOGITS_NONE = "none"  # no logits (a prefill chunk that is not the last)


@dataclass(frozen=True)
class Forward:
    """What a generation needs computed next: ``tokens`` appended to ``session``, and which
    logits it wants back (``LOGITS_LAST``, ``LOGITS_ALL`` or ``LOGITS_NONE``)."""

    session: Any
    tokens: np.ndarray  # int64 rows, checked against the vocabulary and the context
    logits: str = LOGITS_LAST

    @classmethod
    def of(cls, session: Any, token_ids: Sequence[int], logits: str = LOGITS_LAST) -> Forward:
        """Checked: a token outside the vocabulary or rows past the context are refused
        here, before a pass that other sessions may share."""
        return cls(session, session.check(token_ids), logits)

    @property
    def is_prompt(self) -> bool:
        """A prompt's prefill: many rows, the logits after the last (may be cut in chunks)."""
        return self.logits == LOGITS_LAST and len(self.tokens) > 1

    def chunk(self, start: int, stop: int) -> Forward:
        """Rows [start, stop) of this forward: the logits it wants when the chunk ends it,
        none before."""
        logits = self.logits if stop == len(self.tokens) else LOGITS_NONE
        return Forward(self.session, self.tokens[start:stop], logits)


class PassEngine(Protocol):
    """What a pass needs of the engine (engine.Engine): the hidden states of the rows of
    several sessions at once, and the head."""

    def hidden_states(
        self,
        tokens: np.ndarray,
        parts: Sequence[tuple[Any, int]],
        hook: Callable[[int], None] | None,
    ) -> np.ndarray: ...

    def logits(self, hidden: np.ndarray) -> np.ndarray: ...


def run(
    engine: PassEngine, forwards: Sequence[Forward], hook: Callable[[int], None] | None = None
) -> list[np.ndarray | None]:
    """One forward pass for every forward (each session at most once); each session then
    holds its new rows. Returns each forward's logits: [V], [S, V] or None.

    A pass that raises commits nothing: every session holds what it held before."""
    if not forwards:
        return []
    if len({id(f.session) for f in forwards}) != len(forwards):
        raise ValueError("a session can take part in a pass once")
    tokens = np.concatenate([f.tokens for f in forwards])
    hidden = engine.hidden_states(tokens, [(f.session, len(f.tokens)) for f in forwards], hook)
    row = 0
    for f in forwards:
        f.session.commit(f.tokens, hidden[row : row + len(f.tokens)])
        row += len(f.tokens)
    picks: list[int] = []
    spans: list[tuple[int, int] | None] = []
    row = 0
    for f in forwards:
        n = len(f.tokens)
        if f.logits == LOGITS_NONE:
            spans.append(None)
        else:
            first = row if f.logits == LOGITS_ALL else row + n - 1
            spans.append((len(picks), len(picks) + row + n - first))
            picks.extend(range(first, row + n))
        row += n
    logits = engine.logits(hidden[picks]) if picks else None
    out: list[np.ndarray | None] = []
    for f, span in zip(forwards, spans, strict=True):
        if span is None or logits is None:
            out.append(None)
        else:
            part = logits[span[0] : span[1]]
            out.append(part if f.logits == LOGITS_ALL else part[0])
    return out
