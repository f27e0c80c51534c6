"""Kept KV sessions: named conversations and the anonymous prompt cache, within a budget.

Why: chat clients (the HTTP API, `colibri repl`) resend the whole conversation every
turn, and agents resend the same long system prompt with every request. On a model whose
experts stream from disk, prefilling that again costs far more than the answer, so the KV
of finished requests is kept and the next request prefills only what is new.

- A named conversation (the SERVE `conv` field) gets its own session back; its first turn
  starts from the prompt cache like an anonymous request.
- The choices of one request (OpenAI's `n`) start from a copy of the first choice's
  prompt KV once it is computed (`checkout_fork`): the prompt is prefilled once.
- A request without one takes the idle anonymous session that shares the longest prefix
  with its prompt. When the prompt continues that session (it shares all but at most
  `TAKEOVER_SLACK` of its tokens: the next turn of a chat), the request takes it over;
  when it shares only a beginning (the same system prompt, another question) it gets a
  copy of that beginning's KV, and the other session stays cached for its own next turn.
- Idle sessions are dropped least recently used first beyond `max_sessions`, and while
  their KV exceeds `max_kv_bytes` (the KV share of the memory budget), so kept KV never
  takes memory the budget gave to something else.

Reused KV is the same cache a cold run would have built, computed in other batches, so a
continued prompt can differ from a cold run in the last bits of its logits; a prompt seen
whole before is answered from its remembered logits and repeats exactly (`generate`).
`prompt_cache=False` keeps only named conversations (every other request starts cold).

Only sessions whose request finished come back: a request that failed after the engine
ran for it gives its session up (`checkin(discard=True)`), with its remembered logits, so
an error inside one request never changes what a later one computes. Sessions restored
from disk (`adopt`) are verified on first use (`Session.verify` recomputes their last
positions) and dropped with a log line when they do not recompute.
Engine thread only: nothing here locks.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from colibrid.errors import RequestError

log = logging.getLogger("colibrid.sessions")

TAKEOVER_SLACK = 64  # tokens a continuing prompt may drop from the end of a kept session

# (client, conversation name) for a named conversation, (None, serial) for the prompt cache
SessionKey = tuple[int | None, str | int]


class PooledSession(Protocol):
    """What the pool keeps and asks of a session (engine.Session): the tokens it holds,
    a copy of its prefix, a check of restored KV, and its size."""

    tokens: list[int]

    def common_prefix(self, token_ids: Sequence[int]) -> int: ...

    def fork(self, length: int) -> PooledSession: ...

    def verify(self) -> str | None: ...

    def kv_bytes(self) -> int: ...


class SessionPool:
    def __init__(
        self,
        new_session: Callable[[], PooledSession],
        *,
        max_sessions: int,
        max_kv_bytes: int | None = None,
        prompt_cache: bool = True,
    ) -> None:
        self._new = new_session
        self.max_sessions = max(0, max_sessions)
        self.max_kv_bytes = max_kv_bytes
        self.prompt_cache = prompt_cache
        self._idle: OrderedDict[SessionKey, PooledSession] = (
            OrderedDict()
        )  # least recently used first
        self._busy: dict[SessionKey, PooledSession] = {}
        self._dropped: set[SessionKey] = set()  # busy sessions of clients that left
        self._unverified: set[SessionKey] = set()  # restored from disk, not yet recomputed
        self._serial = itertools.count()

    def __len__(self) -> int:
        return len(self._idle) + len(self._busy)

    def kept_kv_bytes(self) -> int:
        return sum(_kv_bytes(s) for s in self._idle.values())

    def checkout(
        self, client: int, conv: str | None, ids: Sequence[int]
    ) -> tuple[SessionKey, PooledSession]:
        """The session a request runs in (busy until `checkin`)."""
        if conv is not None:
            key: SessionKey = (client, conv)
            if key in self._busy:
                raise RequestError(f"conversation {conv!r} has a request running", code="CONV_BUSY")
            session = self._idle.pop(key, None) or self._from_prompt_cache(ids)
        else:
            key = (None, next(self._serial))
            session = self._from_prompt_cache(ids)
        self._busy[key] = session
        return key, session

    def checkout_fork(self, source: SessionKey, length: int) -> tuple[SessionKey, PooledSession]:
        """A new anonymous session (busy until `checkin`) holding a copy of the first
        `length` tokens of the busy session `source`: the other choices of one request
        start from the first choice's prompt while it still runs (serve.host). A session
        like any other: counted in `max_sessions`, its KV kept within the budget once idle."""
        key: SessionKey = (None, next(self._serial))
        session = self._busy[key] = self._busy[source].fork(length)
        return key, session

    def _from_prompt_cache(self, ids: Sequence[int]) -> PooledSession | None:
        """A session for `ids` starting from the anonymous one sharing the longest prefix:
        taken over when `ids` continues it, else a copy of the shared beginning."""
        while True:
            best, shared = None, 0
            if self.prompt_cache:
                for key, session in self._idle.items():
                    if key[0] is None and (n := session.common_prefix(ids)) > shared:
                        best, shared = key, n
            if best is None:
                return self._new()
            if self._trusted(best):
                break
        session = self._idle[best]
        if len(session.tokens) - shared <= TAKEOVER_SLACK:
            del self._idle[best]
            return session
        return session.fork(shared)

    def _trusted(self, key: SessionKey) -> bool:
        """Whether the idle session `key` may be used; a restored one is verified first
        (once) and dropped when it does not recompute."""
        if key not in self._unverified:
            return True
        self._unverified.discard(key)
        session = self._idle[key]
        try:
            reason = session.verify()
        except Exception as exc:  # a failed check is a failed session, never a failed request
            reason = f"{type(exc).__name__}: {exc}"
        if reason is None:
            return True
        log.warning(
            "restored prompt-cache session dropped (%d tokens): %s", len(session.tokens), reason
        )
        del self._idle[key]
        return False

    def checkin(self, key: SessionKey, *, discard: bool = False) -> None:
        """The request ended: keep its session for the next one (or drop it). ``discard``:
        the request failed after the engine ran for it; its session (and remembered
        logits) is not trusted for anything later."""
        session = self._busy.pop(key, None)
        if session is None:
            return
        if key in self._dropped or discard:
            self._dropped.discard(key)
            return
        if (key[0] is not None or self.prompt_cache) and session.tokens:
            self._idle[key] = session
            self._trim()

    def forget_client(self, client: int) -> None:
        """A connection closed: its conversations are not coming back."""
        for key in [k for k in self._idle if k[0] == client]:
            del self._idle[key]
            self._unverified.discard(key)
        self._dropped.update(k for k in self._busy if k[0] == client)

    def cached_prompts(self) -> list[PooledSession]:
        """The idle prompt-cache sessions, most recently used first (what is worth saving)."""
        return [s for key, s in reversed(self._idle.items()) if key[0] is None]

    def adopt(self, sessions: Sequence[PooledSession]) -> None:
        """Take sessions (most recently used first) into the prompt cache, within limits."""
        if not self.prompt_cache:
            return
        for session in reversed(sessions):
            key = (None, next(self._serial))
            self._idle[key] = session
            self._unverified.add(key)
        self._trim()

    def _trim(self) -> None:
        while self._idle and (
            len(self) > self.max_sessions
            or (self.max_kv_bytes is not None and self.kept_kv_bytes() > self.max_kv_bytes)
        ):
            key, _ = self._idle.popitem(last=False)
            self._unverified.discard(key)


def _kv_bytes(session: PooledSession) -> int:
    return int(session.kv_bytes())
