"""Drafting with the checkpoint's multi-token-prediction (MTP) layer (GLM-5.x, DeepSeek-V3).

The MTP layer was trained to guess the token after next: its input at position p is the
main model's final hidden state at p and the embedding of the token at p + 1, and it has
one decoder layer of its own (attention over its own KV cache, a MoE block) and the main
model's LM head. To draft k tokens after the last one sampled (t_L, not yet in the KV):

1. catch up: MTP rows for every position whose hidden state the main model produced
   since the last draft (p < L - 1 with the token p + 1 held; p = L - 1 with t_L) in one
   pass of the MTP layer; the last row's guess is the first draft;
2. chain: each further draft is one more MTP row, fed the previous draft and the MTP
   layer's own (head-normed) hidden state in place of the main model's;
3. the rows at L - 1 and beyond are dropped again: they rest on tokens the session does
   not hold yet, and are recomputed from the main model's own hidden states next time.

A draft is only a guess the main model checks (engine.speculate), so what the MTP layer
computes never changes a token: a random or an int4-damaged MTP layer only drafts badly.
Hidden states wait for the next draft in `MTPState` (at most `HISTORY` positions: older
ones are skipped, and the MTP layer then attends over a shorter history).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from colibrid.engine.kv import KVCache
from colibrid.engine.protocols import DraftingEngine

HISTORY = 2048  # hidden states kept for the next catch-up (positions)
COST_WEIGHT = 0.25  # weight of a new measurement in the running mean of a draft row's time


class MTPState:
    """A session's MTP side: the MTP layer's KV cache (rows for consecutive positions
    from `first`) and the main model's hidden states waiting to be fed to it."""

    def __init__(
        self,
        layout: Mapping[str, tuple[int, ...]],
        max_tokens: int,
        cache: KVCache | None = None,
    ) -> None:
        self.cache = cache if cache is not None else KVCache([layout], max_tokens)
        self.first = 0  # the position of the cache's row 0
        self.hidden_start = 0  # the position of hidden[0]
        self.hidden: list[np.ndarray] = []

    @property
    def covered(self) -> int:
        """Positions before this have an MTP row (or were skipped)."""
        return self.first + self.cache.length

    def note(self, start: int, rows: np.ndarray) -> None:
        """The main model's final hidden states [S, D] for positions start, start + 1, ..."""
        if start != self.hidden_start + len(self.hidden):
            self.hidden, self.hidden_start = [], start
        self.hidden.extend(np.array(rows, dtype=np.float32, copy=True))
        extra = len(self.hidden) - HISTORY
        if extra > 0:
            del self.hidden[:extra]
            self.hidden_start += extra

    def truncate(self, length: int) -> None:
        """The session now holds `length` tokens: an MTP row at p needs the token at
        p + 1 held, a hidden state at p the tokens up to p."""
        keep_rows = max(0, min(self.cache.length, length - 1 - self.first))
        self.cache.truncate(keep_rows)
        del self.hidden[max(0, length - self.hidden_start) :]

    def copy_prefix(self, length: int) -> MTPState:
        """What a session of this one's first `length` tokens holds (engine.Session.fork):
        its MTP rows and its waiting hidden states, copied, so a fork drafts over the
        whole shared history instead of starting over (the arrays themselves are never
        written in place: the hidden states are shared)."""
        keep_rows = max(0, min(self.cache.length, length - 1 - self.first))
        layout = self.cache.layouts[0]
        copy = MTPState(layout, self.cache.max_tokens, self.cache.copy_prefix(keep_rows))
        copy.first = self.first
        copy.hidden_start = self.hidden_start
        copy.hidden = self.hidden[: max(0, length - self.hidden_start)]
        return copy

    def consumed(self, upto: int) -> None:
        """Hidden states before position `upto` have their MTP rows now."""
        drop = min(len(self.hidden), max(0, upto - self.hidden_start))
        del self.hidden[:drop]
        self.hidden_start += drop


class DraftSession(Protocol):
    """What the drafter needs of a session (engine.Session): what it holds, and its MTP
    side."""

    tokens: list[int]
    mtp: MTPState | None

    @property
    def length(self) -> int: ...


class MTPDrafter:
    """Drafts with the MTP layer for one request's session (see the module doc)."""

    name = "mtp"
    free = False  # a pass per draft: the depth is chosen first

    def __init__(self, engine: DraftingEngine, session: DraftSession) -> None:
        self.engine = engine
        self.session = session
        self.last: int | None = None  # the last token fed: sampled, not in the KV yet
        self.row_s: float | None = None  # running mean seconds of one chained draft

    def feed(self, tokens: Sequence[int]) -> None:
        if len(tokens):
            self.last = int(tokens[-1])

    def cost(self, depth: int) -> float:
        """Seconds `depth` drafts take beyond keeping up (the head and the chained rows)."""
        return 0.0 if self.row_s is None else depth * self.row_s

    def keep_up(self) -> None:
        """Feed the MTP layer the hidden states the main model produced since the last
        call (one short pass a step), so a draft never waits for a long catch-up."""
        try:
            self._catch_up()
        finally:
            if self.session.mtp is not None:
                self.session.mtp.truncate(self.session.length)

    def propose(self, limit: int) -> list[int]:
        state: MTPState | None = self.session.mtp
        if limit <= 0 or state is None:
            return []
        length = self.session.length
        try:
            h = self._catch_up()
            if h is None:
                return []
            t0 = time.perf_counter()
            drafts: list[int] = []
            for k in range(limit):
                drafts.append(int(np.argmax(self.engine.logits(h[-1:])[0])))
                if k + 1 == limit:
                    break
                step, x = [drafts[-1]], h[-1:]
                h = self.engine.draft_pass(lambda s=step, p=length + k, x=x: self._rows(p, s, x))
        finally:
            state.truncate(length)  # rows from L - 1 on rest on tokens not held yet
        seconds = (time.perf_counter() - t0) / len(drafts)
        self.row_s = (
            seconds if self.row_s is None else self.row_s + COST_WEIGHT * (seconds - self.row_s)
        )
        return drafts

    def _catch_up(self) -> np.ndarray | None:
        """MTP rows for every position from the first not covered to L - 1 (t_L the last
        token fed; the caller drops the rows from L - 1 on when done with them). The hidden
        states of the rows, or None when the main model's last hidden state is not there
        (a prompt answered from remembered logits: no pass ran)."""
        state: MTPState | None = self.session.mtp
        if state is None or self.last is None:
            return None
        length = self.session.length  # t_L sits at position `length`, its row at length - 1
        start = max(state.covered, state.hidden_start)
        if start > state.covered:  # history skipped: the MTP cache starts over from here
            state.cache.truncate(0)
            state.first = start
        if start > length - 1 or state.hidden_start + len(state.hidden) < length:
            return None
        hidden = np.stack(state.hidden[start - state.hidden_start : length - state.hidden_start])
        nexts = [*self.session.tokens[start + 1 : length], self.last]
        out = self.engine.draft_pass(lambda: self._rows(start, nexts, hidden))
        state.consumed(length - 1)
        return out

    def _rows(self, start: int, next_tokens: Sequence[int], hidden: np.ndarray) -> np.ndarray:
        state: MTPState = self.session.mtp
        model = self.engine.model
        positions = np.arange(start, start + len(next_tokens), dtype=np.int64)
        return model.mtp.draft_hidden(
            model,
            np.asarray(next_tokens, dtype=np.int64),
            hidden,
            positions,
            state.cache,
            self.engine.family,
        )
