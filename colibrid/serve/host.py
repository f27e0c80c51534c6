"""EngineHost: the trio side of the one engine thread.

The engine is synchronous and thread-confined, so one long-lived thread owns it (and every
KV session). The trio side hands it jobs and commands through a thread-safe inbox; the
thread runs the active requests together (engine.batcher: each step is one forward pass
over every request's next rows, each expert fetched once for all of them, each row
computed exactly as alone), so several requests stream at once and a cancelled one
leaves within a step (within one layer when it runs alone). Events go back with
`trio.from_thread.run_sync` onto each job's channel; a closed channel (the client left)
cancels that job.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trio

from colibrid.backends.base import DeviceTierStats
from colibrid.engine import kv_files
from colibrid.engine.batcher import Batcher, Member
from colibrid.engine.constraint import Constraint
from colibrid.engine.generate import DoneEvent, TokenEvent, generation, reusable_prefix
from colibrid.engine.sessions import SessionKey, SessionPool
from colibrid.engine.speculate import OFF, SpecSettings
from colibrid.engine.tokenizer import StreamingDetokenizer, TextCodec
from colibrid.errors import ColibriError, RequestError, contain_panics
from colibrid.serve.events import Accepted, Done, Event, Failed, Progress, Token
from colibrid.serve.requests import GenerateRequest
from colibrid.store.protocol import UsageDelta
from colibrid.store.telemetry import StoreStats

log = logging.getLogger("colibrid.host")


@dataclass
class _Call:
    """An `EngineHost.call` in the inbox: the function, and what it gave back."""

    fn: Callable[[], Any]
    done: trio.Event
    value: Any = None
    error: BaseException | None = None


# A cancel ends a pass between layers or tokens, leaving the session consistent.
CLEAN_ENDS = frozenset({"CANCELLED", "SHUTTING_DOWN"})
PROGRESS_EVERY_S = 1.0  # how often a long prefill reports its progress


class DebugEvent(threading.Event):
    """A cancel flag for tests: every check sleeps `delay_s` (makes prefill and decode
    slow enough to cancel them mid-flight on a tiny model), and with `fail_after` the
    n-th check raises (an injected fault inside a pass: what a failed read or a kernel
    bug does to a request)."""

    def __init__(self, delay_s: float, fail_after: int | None = None) -> None:
        super().__init__()
        self._delay_s = delay_s
        self._checks_left = fail_after

    def is_set(self) -> bool:
        if self._delay_s > 0:
            time.sleep(self._delay_s)
        if self._checks_left is not None:
            self._checks_left -= 1
            if self._checks_left <= 0:
                raise InjectedFault("injected fault (debug_fail_prompt)")
        return super().is_set()


class InjectedFault(RuntimeError):
    """Raised inside a pass by `DebugEvent` (tests only)."""


@dataclass(eq=False)
class Job:
    """One request inside the host; `cancel`/`stop` are set from the trio side."""

    request: GenerateRequest
    send: trio.MemorySendChannel[Event]
    cancel: threading.Event
    stop: threading.Event = field(default_factory=threading.Event)
    on_finish: Callable[[], None] = lambda: None
    member: Member | None = None  # its place in the batch, once started
    session_key: SessionKey | None = None
    cached: int = 0
    # what a cancel that is not a STOP answers: the client's CANCEL, or the daemon stopping
    cancel_code: str = "CANCELLED"


@dataclass(frozen=True)
class HostStatistics:
    active: int
    conversations: int
    requests_done: int
    last_tok_s: float
    last_batch_rows: int = 0  # rows of the last decode pass (requests and their drafts)
    shared_passes: int = 0  # passes that carried several requests
    speculation: dict[str, str] | None = None  # the last finished request's, when on


class UsageSink:
    """Where per-request expert selections are counted (the profile book); a no-op here."""

    def add(self, profile: str | None, delta: UsageDelta) -> None:  # pragma: no cover
        pass


@dataclass(frozen=True)
class StoreView:
    """What the trio side may read of the store: a snapshot the engine thread published
    (the store itself is only ever touched by the engine thread)."""

    stats: StoreStats
    pinned: frozenset[tuple[int, int]]
    vram: DeviceTierStats | None = None  # what the backend holds in device memory


class EngineHost:
    def __init__(
        self,
        engine: Any | None,
        codec: TextCodec | None,
        *,
        max_conversations: int = 8,
        prompt_cache: bool = True,
        layer_delay_s: float = 0.0,
        fail_prompt: str | None = None,
        fail_after: int = 1,
        usage: UsageSink | None = None,
        speculate: SpecSettings = OFF,
    ) -> None:
        self.speculate = speculate
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._max_conversations = max_conversations
        self._prompt_cache = prompt_cache
        self._last_spec: dict[str, str] | None = None
        self._layer_delay_s = layer_delay_s
        self._fail_prompt, self._fail_after = fail_prompt, max(1, fail_after)
        self._done = 0
        self._last_tok_s = 0.0
        self.engine: Any | None = None
        self.codec: TextCodec | None = None
        self._batch: Batcher | None = None
        self._sessions: SessionPool | None = None
        self._usage: UsageSink = UsageSink()
        self.store_view: StoreView | None = None
        if engine is not None:
            self.install(engine, codec, usage)

    # ---- the model (engine thread, or before the thread starts) ------------------------
    def install(self, engine: Any, codec: TextCodec | None, usage: UsageSink | None) -> None:
        """Serve `engine` from now on: fresh sessions (the kept KV is the model's own),
        a fresh batch, its usage counted into `usage` (the model's profile book)."""
        self.engine, self.codec = engine, codec
        self._batch = Batcher(engine, self)
        self._sessions = SessionPool(
            engine.new_session,
            max_sessions=self._max_conversations,
            max_kv_bytes=engine.kv_budget_bytes,
            prompt_cache=self._prompt_cache,
        )
        self._usage = usage or UsageSink()
        self.store_view = self._store_view()

    def uninstall(self) -> Any | None:
        """Serve nothing (no request may run); returns the engine, for the caller to close
        once its prompt cache is saved."""
        assert self._batch is None or not self._batch.members, "requests still run"
        engine = self.engine
        self.engine = self.codec = self._batch = self._sessions = self.store_view = None
        self._usage = UsageSink()
        return engine

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between two steps and return what it returns (or
        raise what it raises), once the snapshot `ps` and STATUS read shows its effect:
        loading and unloading a model, re-pinning, happen there."""
        call = _Call(fn, trio.Event())
        self._inbox.put(call)
        await call.done.wait()
        if call.error is not None:
            raise call.error
        return call.value

    # ---- trio side ----------------------------------------------------------------------
    async def serve(
        self, *, task_status: trio.TaskStatus[EngineHost] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Runs the engine thread until `close`; returns when it has exited."""
        task_status.started(self)
        await trio.to_thread.run_sync(self._thread_main)

    def new_cancel_flag(self, request: GenerateRequest) -> threading.Event:
        """The request's cancel flag (checked between layers); the debug settings make
        it slow, or make the first marked request fail inside its pass."""
        fail = None
        if self._fail_prompt and self._fail_prompt in _request_text(request):
            fail, self._fail_prompt = self._fail_after, None  # one fault per daemon
        if self._layer_delay_s > 0 or fail is not None:
            return DebugEvent(self._layer_delay_s, fail)
        return threading.Event()

    def start(self, job: Job) -> None:
        self._inbox.put(job)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` in the engine thread between two steps (e.g. re-pinning experts)."""
        self._inbox.put(fn)

    def forget_client(self, client: int) -> None:
        """Drop the KV of a closed connection's conversations."""
        self._inbox.put(("forget", client))

    def close(self) -> None:
        """Cancel whatever still runs and end the thread."""
        self._inbox.put(None)

    def restore_prompt_cache(self, directory: Path) -> int:
        """Take in the prompt cache saved when this model was last unloaded or the daemon
        stopped (engine thread, or before it starts); returns how many were usable."""
        if self._sessions is None or not self._sessions.prompt_cache:
            return 0
        sessions = kv_files.load(directory, self.engine)
        self._sessions.adopt(sessions)
        return len(sessions)

    def save_prompt_cache(self, directory: Path) -> int:
        """Write the prompt cache for the next load (engine thread, or after it ended)."""
        if self._sessions is None or not self._sessions.prompt_cache:
            return 0
        return kv_files.save(self._sessions.cached_prompts(), directory, self.engine)

    def statistics(self) -> HostStatistics:
        batch, sessions = self._batch, self._sessions
        return HostStatistics(
            len(batch.members) if batch else 0,
            len(sessions) if sessions is not None else 0,
            self._done,
            self._last_tok_s,
            batch.stats.last_rows if batch else 0,
            batch.stats.shared if batch else 0,
            self._last_spec,
        )

    # ---- engine thread ------------------------------------------------------------------
    def _thread_main(self) -> None:
        closing = False
        while not (closing and not self._running()):
            try:
                item = self._inbox.get(block=not self._running() and not closing, timeout=None)
            except queue.Empty:
                item = ...
            while item is not ...:
                if item is None:
                    closing = True
                    for member in self._batch.members if self._batch else ():
                        member.tag.cancel_code = "SHUTTING_DOWN"
                        member.tag.cancel.set()
                else:
                    self._handle(item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = ...
            if self._running():
                self._batch.step()

    def _running(self) -> bool:
        return self._batch is not None and bool(self._batch.members)

    def _handle(self, item: Any) -> None:
        if isinstance(item, Job):
            self._begin(item)
        elif isinstance(item, tuple) and item[0] == "forget":
            if self._sessions is not None:
                self._sessions.forget_client(item[1])
        elif isinstance(item, _Call):
            try:
                item.value = item.fn()
            except BaseException as exc:  # handed to the caller
                item.error = exc
            self.publish_store()
            try:
                trio.from_thread.run_sync(item.done.set)
            except trio.RunFinishedError:
                pass
        else:
            try:
                item()
            except Exception:
                log.exception("engine-thread command failed")
            self.publish_store()

    def _emit(self, job: Job, event: Event) -> bool:
        try:
            trio.from_thread.run_sync(job.send.send_nowait, event)
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            job.cancel.set()  # nobody listens any more
            return False
        except trio.RunFinishedError:
            job.cancel.set()
            return False

    def _store_view(self) -> StoreView | None:
        if self.engine is None:
            return None
        store = self.engine.experts
        return StoreView(store.statistics(), frozenset(store.pinned_keys()), self._vram())

    def _vram(self) -> DeviceTierStats | None:
        """The backend's device tier now (None without one, or without ops at all)."""
        ops = self.engine.ops
        return ops.device_tier() if ops is not None else None

    def publish_store(self) -> None:
        """Engine thread: refresh the snapshot `ps` and STATUS read."""
        self.store_view = self._store_view()

    def _finish(self, job: Job, event: Event) -> None:
        """Bookkeeping first, so a client that sees the end also sees the engine free. A
        request that failed after the engine ran for it gives its session up (KV rows and
        remembered logits): only finished (or cleanly cancelled) requests are kept."""
        if job.session_key is not None and self._sessions is not None:
            failed = isinstance(event, Failed) and event.code not in CLEAN_ENDS
            ran = job.member is not None and job.member.ran
            self._sessions.checkin(job.session_key, discard=failed and ran)
            job.session_key = None
        log.info("request %s client %d: %s", job.request.id, job.request.client, _summary(event))
        self.publish_store()
        self._done += 1
        try:
            trio.from_thread.run_sync(job.on_finish)
        except trio.RunFinishedError:
            pass
        self._emit(job, event)

    def _begin(self, job: Job) -> None:
        try:
            with contain_panics("a native library"):  # the tokenizer, a template
                prompt_tokens = self._start(job)
        except ColibriError as exc:
            self._finish(job, Failed(exc.code, str(exc)))
            return
        except Exception as exc:  # a bug costs this request only
            log.exception("request %s failed to start", job.request.id)
            self._finish(job, Failed("INTERNAL", f"{type(exc).__name__}: {exc}"))
            return
        assert job.member is not None and self._batch is not None
        self._batch.add(job.member)
        self._emit(job, Accepted(prompt_tokens, job.cached))

    def _start(self, job: Job) -> int:
        """The request's prompt tokenized, its session checked out, its generation made
        into `job.member`, ready to join the batch; returns the prompt's length."""
        if self.engine is None or self._sessions is None or self._batch is None:
            raise RequestError("no model is loaded", code="NO_MODEL")
        ids = self._tokenize(job.request)
        if not ids:
            raise RequestError("the prompt renders to no tokens", code="EMPTY_PROMPT")
        if len(ids) >= self.engine.max_context:
            raise RequestError(
                f"{len(ids)} {self.engine.max_context}: the prompt leaves no "
                "room for a generated token",
                code="CONTEXT_EXCEEDED",
            )
        constraint = self._constraint(job.request)
        job.session_key, session = self._sessions.checkout(
            job.request.client, job.request.conv, ids
        )
        job.cached = reusable_prefix(session, ids)
        detok = StreamingDetokenizer(self.codec) if self.codec else None
        stops = self.codec.stop_token_ids if self.codec else frozenset()
        steps = generation(
            self.engine,
            ids,
            job.request.params,
            stop_token_ids=stops,
            detokenizer=detok,
            cancel=job.cancel,
            session=session,
            speculate=job.request.speculation(self.speculate),
            costs=self._batch.costs,
            constraint=constraint,
        )
        job.member = Member(
            steps, job.cancel, self._progress_reporter(job), job, label=job.request.id
        )
        return len(ids)

    def _progress_reporter(self, job: Job) -> Callable[[int, int], None]:
        """Sends `Progress` during a prefill, first PROGRESS_EVERY_S after it starts and
        then at most that often: a short prefill says nothing, a long one keeps its client
        informed."""
        last: float | None = None

        def report(done: int, total: int) -> None:
            nonlocal last
            now = time.perf_counter()
            if last is None:  # the first layer starts
                last = now
            elif now - last >= PROGRESS_EVERY_S:
                last = now
                self._emit(job, Progress(done, total))

        return report

    def _constraint(self, request: GenerateRequest) -> Constraint | None:
        """The matcher the grammar service built for the request's grammar, which must be
        for the model loaded now (another may have been loaded while it compiled)."""
        if request.grammar is None:
            return None
        constraint = request.constraint
        if constraint is None or constraint.owner != id(self.engine):
            raise RequestError(
                "the model changed while this request's grammar was compiled; send it again",
                code="MODEL_BUSY",
            )
        return constraint

    def _tokenize(self, req: GenerateRequest) -> list[int]:
        if self.codec is None:
            raise RequestError("this model has no tokenizer.json; it cannot take text prompts")
        if req.messages is not None:
            return self.codec.encode_chat(
                list(req.messages),
                add_generation_prompt=True,
                tools=list(req.tools) if req.tools else None,
            )
        return self.codec.encode(req.prompt or "", add_special_tokens=True)

    # ---- the batch's listener ------------------------------------------------------------
    def token(self, member: Member, event: TokenEvent) -> None:
        if event.text:
            self._emit(member.tag, Token(event.text))

    def failed(self, member: Member, code: str, message: str) -> None:
        self._finish(member.tag, Failed(code, message))

    def passed(self, members: Sequence[Member]) -> None:
        """A pass's expert selections go to the usage profile of its requests (each
        profile once: requests of different profiles in one pass are all counted)."""
        store = self.engine.experts
        delta = store.take_usage()
        for profile in dict.fromkeys(m.tag.request.profile for m in members):
            self._usage.add(profile, delta)
        self.store_view = replace(self.store_view, stats=store.statistics(), vram=self._vram())

    def done(self, member: Member, event: DoneEvent) -> None:
        job: Job = member.tag
        stats = event.stats
        self._last_tok_s = stats.decode_tok_s
        spec = None if event.spec is None else event.spec.extras()
        self._last_spec = spec
        grammar = None if event.constraint is None else event.constraint.extras()
        if event.finish_reason == "cancelled" and not job.stop.is_set():
            why = "the daemon stopped" if job.cancel_code == "SHUTTING_DOWN" else "cancelled"
            self._finish(
                job,
                Failed(job.cancel_code, f"{why} after {stats.generated_tokens} generated tokens"),
            )
            return
        finish = "stopped" if event.finish_reason == "cancelled" else event.finish_reason
        self._finish(
            job,
            Done(
                finish,
                stats.prompt_tokens,
                stats.generated_tokens,
                job.cached,
                stats.prefill_s,
                stats.decode_s,
                stats.prefill_tok_s,
                stats.decode_tok_s,
                event.stop_string,
                spec,
                grammar,
            ),
        )


def _summary(event: Event) -> str:
    """A finished request as the log's one line about it (`colibri logs`)."""
    if isinstance(event, Done):
        spec = event.speculation or {}
        drafts = f", {spec['accepted']}/{spec['drafted']} drafts kept" if "drafted" in spec else ""
        grammar = event.constraint or {}
        if grammar:
            drafts += f", {grammar['grammar']} grammar ({grammar['mask_us']} µs a token)"
        return (
            f"{event.prompt_tokens} prompt ({event.cached_tokens} cached) + "
            f"{event.generated_tokens} tokens, prefill {event.prefill_tok_s:.1f} tok/s, "
            f"decode {event.decode_tok_s:.1f} tok/s, finish={event.finish}{drafts}"
        )
    if isinstance(event, Failed):
        return f"failed {event.code}: {event.message}"
    return type(event).__name__


def _request_text(request: GenerateRequest) -> str:
    if request.messages is not None:
        return " ".join(str(m.get("content", "")) for m in request.messages)
    return request.prompt or ""
