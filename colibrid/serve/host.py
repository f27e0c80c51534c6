"""EngineHost: the trio side of the one engine thread.

The engine is synchronous and thread-confined, so one long-lived thread owns it (and every
KV session). The trio side hands it jobs and commands through a thread-safe inbox; the
thread runs the active requests together (engine.batcher: each step is one forward pass
over every request's next rows, each expert fetched once for all of them, each row
computed exactly as alone), so several requests stream at once and a cancelled one
leaves within a step (within one layer when it runs alone). Events go back onto each
job's channel through the loop's `run_sync_soon` queue, without waiting: a blocking
hand-off made the engine thread wait for the loop (and the GIL it then holds) after
every token. The loop runs them in order; a closed channel (the client left) cancels
that job. The choices of one OpenAI `n` request prefill their prompt once: the others
wait (parked, not in the batch) until the first holds the prompt, then start from a copy.
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
from colibri_protocol.messages import Alternative, Logprobs

from colibrid.backends.base import DeviceTierStats
from colibrid.engine import kv_files
from colibrid.engine.batcher import PREFILL_CHUNK, Batcher, Member
from colibrid.engine.engine import Engine
from colibrid.engine.events import DoneEvent, TokenEvent
from colibrid.engine.logprobs import TokenLogprobs
from colibrid.engine.request_run import RequestRun, reusable_prefix
from colibrid.engine.sessions import SessionKey, SessionPool
from colibrid.engine.speculate import OFF, SpecSettings
from colibrid.engine.tokenizer import StreamingDetokenizer, TextCodec
from colibrid.errors import ColibriError, RequestError, contain_panics
from colibrid.serve.events import Accepted, Done, Event, Failed, Progress, Token, summary
from colibrid.serve.faults import FaultPlan
from colibrid.serve.requests import GenerateRequest
from colibrid.serve.roofline import Ceilings, PassMeter, RequestShare
from colibrid.serve.roofline import measure as measure_ceilings
from colibrid.store.protocol import UsageDelta
from colibrid.store.telemetry import StoreStats

log = logging.getLogger("colibrid.host")


@dataclass(eq=False)
class Invoke:
    """An `EngineHost.call` in the inbox: the function, and what it gave back."""

    fn: Callable[[], Any]
    done: trio.Event
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Command:
    """Run `fn` between two steps, nobody waiting (e.g. re-pinning)."""

    fn: Callable[[], None]


@dataclass(frozen=True)
class Forget:
    """A connection closed: drop its conversations' KV."""

    client: int


@dataclass(frozen=True)
class Close:
    """End the thread, cancelling what still runs."""


# A cancel ends a pass between layers or tokens, leaving the session consistent.
CLEAN_ENDS = frozenset({"CANCELLED", "SHUTTING_DOWN"})
PROGRESS_EVERY_S = 1.0  # how often a long prefill reports its progress


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
    # another choice of the same prompt (OpenAI's `n`): this one starts from a copy of its
    # prompt KV once computed (Scheduler.submit_nowait's `same_prompt_as`)
    leader: Job | None = None
    # its part of the decode passes it ran in (serve.roofline: DONE's roofline figures)
    share: RequestShare = field(default_factory=RequestShare)


@dataclass(frozen=True)
class HostStatistics:
    active: int
    conversations: int
    requests_done: int
    last_tok_s: float
    last_batch_rows: int = 0  # rows of the last decode pass (requests and their drafts)
    shared_passes: int = 0  # passes that carried several requests
    # the last finished request's, when on: SpecStats.as_json (numbers as numbers)
    speculation: dict[str, str | int | float] | None = None
    # the last finished request's roofline figures (serve.roofline.RequestShare.figures)
    roofline: dict[str, float | str] | None = None


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


Item = Job | Invoke | Command | Forget | Close  # what the engine thread's inbox carries


class EngineHost:
    """The engine thread and the requests it runs (see the module doc). The trio side
    puts typed items in the inbox (`start`, `call`, `call_soon`, `forget_client`,
    `close`); the thread takes them between steps and runs the batch's steps."""

    def __init__(
        self,
        engine: Engine | None,
        codec: TextCodec | None,
        *,
        max_conversations: int = 8,
        prompt_cache: bool = True,
        faults: FaultPlan | None = None,
        usage: UsageSink | None = None,
        speculate: SpecSettings = OFF,
    ) -> None:
        self.speculate = speculate
        self._inbox: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self._max_conversations = max_conversations
        self._prompt_cache = prompt_cache
        self._faults = faults or FaultPlan()
        self._last_spec: dict[str, str | int | float] | None = None
        self._done = 0
        self._last_tok_s = 0.0
        self.engine: Engine | None = None
        self.codec: TextCodec | None = None
        self._batch: Batcher | None = None
        self._sessions: SessionPool | None = None
        self._usage: UsageSink = UsageSink()
        self.store_view: StoreView | None = None
        self._loop: trio.lowlevel.TrioToken | None = None  # the event loop `serve` runs in
        self._parked: list[Job] = []  # choices waiting for their leader's prompt (`_begin`)
        # the machine's limits for the loaded model (serve.roofline), measured by the
        # daemon after a load (`measure_ceilings`) and when idle; None until then
        self.ceilings: Ceilings | None = None
        self._probes = 0
        self._meter: PassMeter | None = None
        self._last_roofline: dict[str, float | str] | None = None
        if engine is not None:
            self.install(engine, codec, usage)

    # ---- the model (engine thread, or before the thread starts) ------------------------
    def install(self, engine: Engine, codec: TextCodec | None, usage: UsageSink | None) -> None:
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
        self.ceilings = None  # the last model's limits are not this one's
        self._meter = PassMeter(engine.experts.stats)

    def measure_ceilings(self) -> Ceilings | None:
        """Engine thread (or before it starts): probe the disk and memory for the loaded
        model, unless a request runs or waits for its prompt's leader (serve.roofline:
        a probe beside a request would skew both). Returns the ceilings now held."""
        if self.engine is None or self._running() or self._parked:
            return self.ceilings
        self._probes += 1
        try:
            self.ceilings = measure_ceilings(self.engine, self._probes)
        except (OSError, MemoryError, ColibriError) as exc:  # costs the figures, not the model
            log.warning("the roofline's probes failed (%s); keeping the last ceilings", exc)
            return self.ceilings
        return self.ceilings

    def _rebase_meter(self) -> None:
        """Work between passes (a probe, re-pinning's reads) is no request's: the next
        pass is measured from here."""
        if self._meter is not None and self.engine is not None:
            self._meter = PassMeter(self.engine.experts.stats)

    def refresh_ceilings(self) -> None:
        """`measure_ceilings` for the idle refresh (serve.roofline.refresh_when_idle)."""
        self.measure_ceilings()

    def uninstall(self) -> Engine | None:
        """Serve nothing (no request may run); returns the engine, for the caller to close
        once its prompt cache is saved."""
        assert self._batch is None or not self._batch.members, "requests still run"
        engine = self.engine
        self.engine = self.codec = self._batch = self._sessions = self.store_view = None
        self.ceilings = self._meter = None
        self._usage = UsageSink()
        return engine

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between two steps and return what it returns (or
        raise what it raises), once the snapshot `ps` and STATUS read shows its effect:
        loading and unloading a model, re-pinning, happen there."""
        call = Invoke(fn, trio.Event())
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
        self._loop = trio.lowlevel.current_trio_token()
        task_status.started(self)
        await trio.to_thread.run_sync(self._thread_main)

    def new_cancel_flag(self, request: GenerateRequest) -> threading.Event:
        """The request's cancel flag (checked between layers; the test hooks may slow it
        or make it fail: serve.faults)."""
        return self._faults.cancel_flag(request.prompt, request.messages)

    def start(self, job: Job) -> None:
        self._inbox.put(job)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` in the engine thread between two steps (e.g. re-pinning experts)."""
        self._inbox.put(Command(fn))

    def forget_client(self, client: int) -> None:
        """Drop the KV of a closed connection's conversations."""
        self._inbox.put(Forget(client))

    def close(self) -> None:
        """Cancel whatever still runs and end the thread."""
        self._inbox.put(Close())

    def restore_prompt_cache(self, directory: Path) -> int:
        """Take in the prompt cache saved when this model was last unloaded or the daemon
        stopped (engine thread, or before it starts); returns how many were usable."""
        if self._sessions is None or not self._sessions.prompt_cache or self.engine is None:
            return 0
        sessions = kv_files.load(directory, self.engine)
        self._sessions.adopt(sessions)
        return len(sessions)

    def save_prompt_cache(self, directory: Path) -> int:
        """Write the prompt cache for the next load (engine thread, or after it ended)."""
        if self._sessions is None or not self._sessions.prompt_cache or self.engine is None:
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
            self._last_roofline,
        )

    # ---- engine thread ------------------------------------------------------------------
    def _thread_main(self) -> None:
        closing = False
        while not (closing and not self._running()):
            closing = self._handle_inbox(block=not self._running() and not closing) or closing
            if self._running():
                self._batch.step()
                if self._parked:
                    self._unpark()

    def _handle_inbox(self, *, block: bool) -> bool:
        """Handle what the inbox holds; True once it asked the thread to close. Its own
        frame, so no item outlives its handling: a finished unload's closure would keep
        the unloaded model's weights mapped while the thread waits."""
        closing = False
        for item in self._take_inbox(block=block):
            if isinstance(item, Close):
                closing = True
                self._cancel_all("SHUTTING_DOWN")
            else:
                self._handle(item)
        return closing

    def _take_inbox(self, *, block: bool) -> list[Item]:
        """What the inbox holds now (waiting for one item when ``block``)."""
        items: list[Item] = []
        try:
            items.append(self._inbox.get(block=block))
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return items

    def _cancel_all(self, code: str) -> None:
        jobs = [m.tag for m in self._batch.members] if self._batch else []
        for job in [*jobs, *self._parked]:
            job.cancel_code = code
            job.cancel.set()

    def _running(self) -> bool:
        return self._batch is not None and bool(self._batch.members)

    def _handle(self, item: Item) -> None:
        if isinstance(item, Job):
            self._begin(item)
        elif isinstance(item, Forget):
            if self._sessions is not None:
                self._sessions.forget_client(item.client)
        elif isinstance(item, Invoke):
            self._invoke(item)
        elif isinstance(item, Command):
            try:
                with contain_panics("a native library"):
                    item.fn()
            except Exception:
                log.exception("engine-thread command failed")
            self._rebase_meter()
            self.publish_store()

    def _invoke(self, call: Invoke) -> None:
        try:
            call.value = call.fn()
        except BaseException as exc:  # handed to the caller
            call.error = exc
        self._rebase_meter()
        self.publish_store()
        try:
            trio.from_thread.run_sync(call.done.set)
        except trio.RunFinishedError:
            pass

    def _emit(self, job: Job, event: Event) -> None:
        """Queue ``event`` for the job's channel and go on (the loop delivers it)."""
        assert self._loop is not None, "events are emitted while `serve` runs"
        try:
            self._loop.run_sync_soon(_deliver, job, event)
        except trio.RunFinishedError:
            job.cancel.set()

    def _store_view(self) -> StoreView | None:
        if self.engine is None:
            return None
        store = self.engine.experts
        return StoreView(store.statistics(), frozenset(store.pinned_keys()), self._vram())

    def _vram(self) -> DeviceTierStats | None:
        """The backend's device tier now (None without one)."""
        return self.engine.ops.device_tier() if self.engine is not None else None

    def publish_store(self) -> None:
        """Engine thread: refresh the snapshot `ps` and STATUS read."""
        self.store_view = self._store_view()

    # ---- a request's boundaries -----------------------------------------------------------
    def _begin(self, job: Job) -> None:
        if self._waits_for_prompt(job):
            self._parked.append(job)  # started by `_unpark` once the prompt is in
            return
        try:
            with contain_panics("a native library"):  # the detokenizer, a grammar
                self._start(job)
        except ColibriError as exc:
            self._finish(job, Failed(exc.code, str(exc)))
            return
        except Exception as exc:  # a bug costs this request only
            log.exception("request %s failed to start", job.request.id)
            self._finish(job, Failed("INTERNAL", f"{type(exc).__name__}: {exc}"))
            return
        assert job.member is not None and self._batch is not None
        self._batch.add(job.member)
        self._emit(job, Accepted(len(job.member.run.ids), job.cached))

    def _start(self, job: Job) -> None:
        """The request's session checked out and its run made into `job.member`, ready
        to join the batch: its ids (and matcher) were made on the trio side
        (serve.prepare) for the engine loaded now, or it is refused."""
        engine, sessions, batch, request = self.engine, self._sessions, self._batch, job.request
        if engine is None or sessions is None or batch is None:
            raise RequestError("no model is loaded", code="NO_MODEL")
        if request.prompt_ids is None or request.owner != id(engine):
            raise RequestError(
                "the model changed while this request was being prepared; send it again",
                code="MODEL_BUSY",
            )
        ids = list(request.prompt_ids)
        source = self._prompt_source(job)
        if source is not None:  # another choice computed this prompt: a copy of its KV
            job.session_key, session = sessions.checkout_fork(source, len(ids))
        else:
            job.session_key, session = sessions.checkout(request.client, request.conv, ids)
        job.cached = reusable_prefix(session, ids)
        codec = self.codec
        run = RequestRun(
            engine,
            ids,
            request.params,
            stop_token_ids=codec.stop_token_ids if codec else frozenset(),
            detokenizer=StreamingDetokenizer(codec) if codec else None,
            cancel=job.cancel,
            session=session,
            speculate=request.speculation(self.speculate),
            costs=batch.costs,
            constraint=request.constraint,
        )
        job.member = Member(run, job.cancel, self._progress_reporter(job), job, label=request.id)

    # ---- the choices of one prompt (OpenAI's `n`) ----------------------------------------------
    def _prompt_source(self, job: Job) -> SessionKey | None:
        """The session of the choice `job` shares its prompt with, once that one holds the
        whole prompt and the logits after it: `job` then starts from a copy and prefills
        nothing (its first token is sampled from the very logits its leader's was, so it
        computes exactly what it would alone)."""
        leader = job.leader
        if leader is None or leader.member is None or leader.session_key is None:
            return None
        session, ids = leader.member.run.session, job.request.prompt_ids
        if session is None or ids is None or session.common_prefix(ids) < len(ids):
            return None
        return leader.session_key if session.logits_at(len(ids)) is not None else None

    def _waits_for_prompt(self, job: Job) -> bool:
        """A choice whose leader is still computing their prompt waits for it (a leader
        that has ended leaves it to start as any request: the prompt cache then holds
        the prompt)."""
        leader = job.leader
        return leader is not None and leader.member is not None and self._prompt_source(job) is None

    def _unpark(self) -> None:
        """After a step: the waiting choices whose prompt is in start from it; a cancelled
        one ends now; the others wait on."""
        parked, self._parked = self._parked, []
        for job in parked:
            try:
                cancelled = job.cancel.is_set()
            except Exception as exc:  # an injected fault in the check itself
                self._finish(job, Failed("INTERNAL", f"{type(exc).__name__}: {exc}"))
                continue
            if cancelled:
                self._finish(job, Failed(job.cancel_code, "cancelled before it started"))
            else:
                self._begin(job)

    def _release_followers(self, leader: Job) -> None:
        """`leader` ended: the choices waiting for it elect the first of them to lead the
        rest (it starts from the prompt cache, or computes the prompt once more)."""
        followers = [p for p in self._parked if p.leader is leader]
        if not followers:
            return
        self._parked = [p for p in self._parked if p.leader is not leader]
        for follower in followers:
            follower.leader = followers[0]
        followers[0].leader = None
        self._parked.extend(followers)
        self._unpark()

    def _finish(self, job: Job, event: Event) -> None:
        """The request leaves: bookkeeping first, so a client that sees the end also sees
        the engine free. The engine is told when it ran for the request (the store saves
        its usage profile and re-pins: the host owns a request's boundaries). A request
        that failed after the engine ran for it gives its session up (KV rows and
        remembered logits): only finished (or cleanly cancelled) requests are kept."""
        ran = job.member is not None and job.member.ran
        if job.session_key is not None and self._sessions is not None:
            failed = isinstance(event, Failed) and event.code not in CLEAN_ENDS
            self._sessions.checkin(job.session_key, discard=failed and ran)
            job.session_key = None
        if job.member is not None and self.engine is not None:
            try:
                self.engine.request_finished()
            except Exception:  # the profile's save failing costs no request its answer
                log.exception("request %s: the store's end of request failed", job.request.id)
        log.info("request %s client %d: %s", job.request.id, job.request.client, summary(event))
        # The Job outlives the request (the scheduler, the client's handle): its run, which
        # holds a session and so the engine, must not, or an unloaded model stays mapped.
        job.member = None
        self.publish_store()
        self._release_followers(job)
        self._done += 1
        try:
            trio.from_thread.run_sync(job.on_finish)
        except trio.RunFinishedError:
            pass
        self._emit(job, event)

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

    # ---- the batch's listener ------------------------------------------------------------
    def token(self, member: Member, event: TokenEvent) -> None:
        if event.logprobs is not None and self.codec is not None:
            self._emit(member.tag, Token(event.text, self._logprobs(member.tag, event.logprobs)))
        elif event.text:
            self._emit(member.tag, Token(event.text))

    def _logprobs(self, job: Job, lp: TokenLogprobs) -> Logprobs:
        """The engine's logprobs with each token's bytes (the codec knows them)."""
        codec = self.codec
        assert codec is not None

        def alt(token: int, logprob: float) -> Alternative:
            return Alternative(token, codec.token_bytes(token), logprob)

        top = tuple(alt(t, v) for t, v in lp.top)
        return Logprobs(job.request.id, alt(lp.token_id, lp.logprob), top)

    def failed(self, member: Member, code: str, message: str) -> None:
        self._finish(member.tag, Failed(code, message))

    def passed(self, members: Sequence[Member]) -> None:
        """A pass's expert selections go to the usage profile of its requests (each
        profile once: requests of different profiles in one pass are all counted)."""
        assert self.engine is not None and self.store_view is not None
        store = self.engine.experts
        delta = store.take_usage()
        for profile in dict.fromkeys(m.tag.request.profile for m in members):
            self._usage.add(profile, delta)
        if self._meter is not None and self.ceilings is not None:
            self._meter.charge(store.stats, _pass_rows(members), self.ceilings)
        self.store_view = replace(self.store_view, stats=store.statistics(), vram=self._vram())

    def done(self, member: Member, event: DoneEvent) -> None:
        job: Job = member.tag
        stats = event.stats
        self._last_tok_s = stats.decode_tok_s
        self._last_spec = None if event.spec is None else event.spec.as_json()
        roofline = job.share.figures(stats, self.ceilings)
        self._last_roofline = roofline or self._last_roofline
        if event.finish_reason == "cancelled" and not job.stop.is_set():
            why = "the daemon stopped" if job.cancel_code == "SHUTTING_DOWN" else "cancelled"
            self._finish(
                job,
                Failed(job.cancel_code, f"{why} after {stats.generated_tokens} generated tokens"),
            )
            return
        plan = None if self.engine is None else self.engine.info.plan.id
        self._finish(job, Done.of(event, job.cached, plan, roofline))


def _pass_rows(members: Sequence[Member]) -> list[tuple[RequestShare | None, int]]:
    """Each member's share and rows in the pass that just ran (its forward is still
    set): a decode or verify all its rows, a prompt the chunk it took (batcher._compose:
    whole when alone, else up to PREFILL_CHUNK) with no share, since no decode figure
    counts a prefill."""
    rows: list[tuple[RequestShare | None, int]] = []
    for m in members:
        fwd = m.forward
        if fwd is None:  # cancelled before the pass ended: it took no part
            continue
        if fwd.is_prompt:
            left = len(fwd.tokens) - m.done_rows
            rows.append((None, left if len(members) == 1 else min(left, PREFILL_CHUNK)))
        else:
            rows.append((m.tag.share, len(fwd.tokens)))
    return rows


def _deliver(job: Job, event: Event) -> None:
    """Event loop: put ``event`` on the job's channel (unbounded); a channel nobody reads
    any more cancels the job, which leaves the batch at its next step."""
    try:
        job.send.send_nowait(event)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        job.cancel.set()
