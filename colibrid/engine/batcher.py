"""Continuous batching: every step is one forward pass over the next rows of every request.

Each request is a `RequestRun` (engine.request_run) that asks for passes. A step gives
every member what its last pass produced and takes its next request for a pass, runs all
of them as one (engine.batch: each row computed alone, each expert fetched once for every
row that chose it). Members join and leave between steps.

What a step carries: every decode and speculative verify whole; prompts whole when they
are the only member, else at most `PREFILL_CHUNK` tokens a step between them (so the
members decoding keep streaming while a long prompt is read; chunking changes no bit).

Cancels: a pass whose every member is cancelled is abandoned between layers (a lone
request's cancel acts within one layer, as it did before batching); a member cancelled
in a shared pass leaves after it (its generation checks between tokens), and a prompt
waiting for its next chunk leaves at once, its session given back what it held before.

Faults: a pass that raises commits nothing. A fault traced to one member (an injected
fault in its cancel check) fails that member; one that cannot be traced runs the members
of that pass one at a time until the failing one shows itself. The others lose nothing.

The daemon's engine host and `colibri bench batch` drive this; a `Listener` hears tokens
and ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from colibrid.engine.batch import LOGITS_NONE, Forward
from colibrid.engine.events import DoneEvent, GenEvent, TokenEvent
from colibrid.engine.protocols import EngineLike
from colibrid.engine.request_run import RequestRun
from colibrid.engine.speculate import PassCosts
from colibrid.errors import Cancelled, ColibriError, contain_panics

log = logging.getLogger("colibrid.batch")

PREFILL_CHUNK = 256  # prompt tokens a step takes while other requests share the engine


@dataclass(eq=False)
class Member:
    """One request in the batch: its run and what the batcher keeps for it."""

    run: RequestRun
    cancel: threading.Event | None = None
    progress: Callable[[int, int], None] | None = None  # (layers done, layers) of a prompt
    tag: Any = None  # the driver's own record of the request
    forward: Forward | None = None  # the pass its generation waits for
    done_rows: int = 0  # of `forward`, rows already computed (a prompt taken in chunks)
    reply: np.ndarray | Cancelled | None = None  # for the run: its pass's logits, or a cancel
    started: bool = False  # the run has begun
    ran: bool = False  # a pass has run (or tried to) with its rows
    label: str = ""  # for log lines

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


class Listener(Protocol):
    def token(self, member: Member, event: TokenEvent) -> None: ...

    def done(self, member: Member, event: DoneEvent) -> None:
        """The generation ended (any finish reason, "cancelled" included)."""

    def failed(self, member: Member, code: str, message: str) -> None:
        """The request failed (an error code of the SERVE protocol)."""

    def passed(self, members: Sequence[Member]) -> None:
        """A pass with these members ended (ran, was abandoned or failed)."""


@dataclass
class BatchStats:
    passes: int = 0
    shared: int = 0  # passes that carried several requests
    rows: int = 0  # rows of every pass
    decode_passes: int = 0
    decode_rows: int = 0  # rows of the passes that carried no prompt
    last_rows: int = 0  # of the last decode pass


@dataclass
class Batcher:
    engine: EngineLike
    listener: Listener
    costs: PassCosts = field(default_factory=PassCosts)
    members: list[Member] = field(default_factory=list)
    stats: BatchStats = field(default_factory=BatchStats)
    _isolate: list[Member] = field(default_factory=list)

    def add(self, member: Member) -> None:
        self.members.append(member)

    def step(self) -> None:
        """Advance every member to its next pass, and run that pass."""
        self.costs.sharing = len(self.members) - 1  # what a draft's rows ride beside
        ready = [m for m in list(self.members) if self._advance(m)]
        if not ready:
            return
        if self._isolate:  # a shared pass failed untraced: one member a pass until found
            suspect = next((m for m in self._isolate if m in ready), None)
            if suspect is None:
                self._isolate.clear()
            else:
                self._isolate.remove(suspect)
                ready = [suspect]
        parts = self._compose(ready)
        chosen = {id(m) for m, _ in parts}
        for m in ready:  # prompts that wait for a later step still hear their cancel
            if id(m) not in chosen:
                self._cancel_waiting(m)
        if parts:
            self._run(parts)

    # ---- members' generations ---------------------------------------------------------
    def _end(self, member: Member) -> None:
        if member in self.members:
            self.members.remove(member)
        if member in self._isolate:
            self._isolate.remove(member)
        member.forward = None

    def _fail(self, member: Member, code: str, message: str) -> None:
        self._end(member)
        self.listener.failed(member, code, message)

    def _advance(self, member: Member) -> bool:
        """Give the request what its last pass produced (or start it) and hand its events
        on as they come: True when it then waits for a pass, False when it has ended."""
        if member.forward is not None:
            return True
        try:
            with contain_panics("a native library"):  # tokenizers, llguidance
                for event in self._feed(member):
                    if isinstance(event, TokenEvent):
                        self.listener.token(member, event)
                        continue
                    self._end(member)
                    self.listener.done(member, event)
                    return False
        except ColibriError as exc:
            self._fail(member, exc.code, str(exc))
            return False
        except Exception as exc:
            log.exception("request %s failed", member.label)
            self._fail(member, "INTERNAL", f"{type(exc).__name__}: {exc}")
            return False
        return self._ask(member)

    def _feed(self, member: Member) -> Iterator[GenEvent]:
        reply, member.reply = member.reply, None
        if not member.started:
            member.started = True
            return member.run.begin()
        if isinstance(reply, Cancelled):
            return iter([member.run.abandon()])
        assert reply is not None
        return member.run.take(reply)

    def _ask(self, member: Member) -> bool:
        """The member's next pass, checked here rather than inside a pass others share."""
        wanted = member.run.next_pass()
        if wanted is None:
            self._fail(member, "INTERNAL", "the generation ended without an answer")
            return False
        try:
            member.forward = Forward(
                wanted.session, wanted.session.check(wanted.tokens), wanted.logits
            )
        except ColibriError as exc:
            self._fail(member, exc.code, str(exc))
            return False
        member.done_rows = 0
        return True

    def _cancel_waiting(self, member: Member) -> None:
        """A member cancelled while waiting for its next pass leaves now, its session
        holding what it held before that pass (a prompt's chunks are given back)."""
        try:
            cancelled = member.cancelled()
        except Exception as exc:  # an injected fault in the check itself
            member.ran = True
            self._fail(member, "INTERNAL", f"{type(exc).__name__}: {exc}")
            return
        if not cancelled or member.forward is None:
            return
        session, rows = member.forward.session, member.done_rows
        if rows:
            session.truncate(session.length - rows)
        member.forward, member.reply = None, Cancelled("request cancelled")
        self._advance(member)  # the generation answers with its end

    # ---- one pass -----------------------------------------------------------------------
    def _compose(self, ready: list[Member]) -> list[tuple[Member, Forward]]:
        """Every decode and verify whole; prompts whole when alone, else up to
        PREFILL_CHUNK tokens a step between them, in arrival order."""
        parts: list[tuple[Member, Forward]] = []
        prompts: list[Member] = []
        for m in ready:
            assert m.forward is not None
            if m.forward.is_prompt:
                prompts.append(m)
            else:
                parts.append((m, m.forward))
        room = None if len(ready) == 1 else PREFILL_CHUNK
        for m in prompts:
            fwd = m.forward
            assert fwd is not None
            take = len(fwd.tokens) - m.done_rows
            if room is not None:
                take = min(take, room)
                room -= take
            if take <= 0:
                break
            parts.append((m, fwd.chunk(m.done_rows, m.done_rows + take)))
        return parts

    def _run(self, parts: list[tuple[Member, Forward]]) -> None:
        members = [m for m, _ in parts]
        culprit: list[Member] = []
        rows = sum(len(f.tokens) for _, f in parts)
        for m in members:
            m.ran = True
        t0 = time.perf_counter()
        try:
            outs = self.engine.run([f for _, f in parts], self._hook(parts, culprit))
        except Cancelled:  # every member of the pass was cancelled: they leave now
            for m in members:
                self._cancel_waiting(m)
            return
        except Exception as exc:
            self._failed_pass(members, culprit, exc)
            return
        finally:
            self.listener.passed(members)
        self.costs.observe(rows, time.perf_counter() - t0)
        st = self.stats
        st.passes += 1
        st.shared += len(parts) > 1
        st.rows += rows
        if not any(f.is_prompt or f.logits == LOGITS_NONE for _, f in parts):
            st.decode_passes += 1
            st.decode_rows += rows
            st.last_rows = rows
        for (m, part), out in zip(parts, outs, strict=True):
            m.done_rows += len(part.tokens)
            assert m.forward is not None
            if m.done_rows == len(m.forward.tokens):
                m.forward, m.reply = None, out

    def _hook(
        self, parts: list[tuple[Member, Forward]], culprit: list[Member]
    ) -> Callable[[int], None]:
        """Before each layer: a pass whose every member is cancelled is abandoned; prompts
        report their progress. A check that raises (an injected fault) names its member."""
        layers = self.engine.info.n_layers
        prompts = [(m, part) for m, part in parts if m.forward and m.forward.is_prompt]

        def hook(index: int) -> None:
            live = False
            for m, _ in parts:
                try:
                    live = not m.cancelled() or live
                except BaseException:
                    culprit.append(m)
                    raise
            if not live:
                raise Cancelled("request cancelled")
            for m, part in prompts:
                if m.progress is not None and m.forward is not None:
                    done = m.done_rows + len(part.tokens) * index / layers
                    m.progress(int(layers * done / len(m.forward.tokens)), layers)

        return hook

    def _failed_pass(self, members: list[Member], culprit: list[Member], exc: Exception) -> None:
        """A pass raised and committed nothing: the member it is traced to fails; the
        others keep their next rows and run again (one member a pass when untraced)."""
        code = exc.code if isinstance(exc, ColibriError) else "INTERNAL"
        message = str(exc) if isinstance(exc, ColibriError) else f"{type(exc).__name__}: {exc}"
        blamed = culprit[:1] if culprit else (members if len(members) == 1 else [])
        if not blamed:
            log.warning(
                "a pass of %d requests failed (%s); running them one at a time",
                len(members),
                message,
            )
            self._isolate.extend(m for m in members if m not in self._isolate)
            return
        if code == "INTERNAL":
            log.error("request %s failed: %s", blamed[0].label, message)
        for m in blamed:
            self._fail(m, code, message)
