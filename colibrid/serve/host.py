"""EngineHost: the trio side of the one engine thread, and the batching of requests.

The engine is synchronous and thread-confined, so one long-lived thread owns it (and every
KV session). The trio side hands it jobs and commands through a thread-safe inbox. Each
engine step is one forward pass carrying the next rows of every active request: one
token each for those decoding (more when a request verifies speculative drafts), and a
chunk of the prompt of those prefilling (a whole prompt when nothing else is running;
at most `PREFILL_CHUNK` tokens a step otherwise, so decoding requests keep streaming).
Each MoE layer of the pass fetches the union of its rows' experts once, and every row is
computed exactly as it would be alone (engine.batch), so a request's answer never
depends on what ran beside it.

A request's generation is a coroutine (engine.generate.generation) that asks for passes
and is sent their logits; events go back with `trio.from_thread.run_sync` onto each job's
channel, and a closed channel (the client left) cancels that job. A cancel ends a pass
between layers when it is the pass's only request (within one layer during a prefill),
else the request leaves after the pass it is in. A pass that fails costs the request it
can be traced to; one that cannot be traced runs its requests one at a time until the
failing one shows itself, so a fault in one request never fails the others.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trio

from colibrid.engine import kv_files
from colibrid.engine.batch import LOGITS_NONE, Forward
from colibrid.engine.generate import DoneEvent, Generation, TokenEvent, generation, reusable_prefix
from colibrid.engine.sessions import SessionKey, SessionPool
from colibrid.engine.speculate import OFF, PassCosts, SpecSettings, SpecStats
from colibrid.engine.tokenizer import StreamingDetokenizer, TextCodec
from colibrid.errors import Cancelled, ColibriError, RequestError
from colibrid.serve.events import Accepted, Done, Event, Failed, Progress, Token
from colibrid.serve.requests import GenerateRequest
from colibrid.store.protocol import UsageDelta
from colibrid.store.telemetry import StoreStats

log = logging.getLogger("colibrid.host")

# A cancel ends a pass between layers or tokens, leaving the session consistent.
CLEAN_ENDS = frozenset({"CANCELLED", "SHUTTING_DOWN"})
PROGRESS_EVERY_S = 1.0  # how often a long prefill reports its progress
PREFILL_CHUNK = 256  # prompt tokens a step takes while other requests share the engine


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
    steps: Generation | None = None
    session_key: SessionKey | None = None
    cached: int = 0
    ran: bool = False  # the engine has worked for it (its session may hold its rows)
    # what a cancel that is not a STOP answers: the client's CANCEL, or the daemon stopping
    cancel_code: str = "CANCELLED"
    forward: Forward | None = None  # the pass its generation waits for
    done_rows: int = 0  # of `forward`, rows already computed (a prompt taken in chunks)
    reply: Any = None  # what to send the generation next (the forward's logits)
    progress: Callable[[int, int], None] | None = None


@dataclass(frozen=True)
class HostStatistics:
    active: int
    conversations: int
    requests_done: int
    last_tok_s: float
    last_batch_rows: int = 0  # rows of the last decode pass (requests and their drafts)
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


class EngineHost:
    def __init__(
        self,
        engine: Any,
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
        self.engine = engine
        self.speculate = speculate
        self._costs = PassCosts()  # pass seconds by rows: what a draft depth is priced at
        self._isolate: list[Job] = []  # run one at a time: a shared pass failed untraced
        self._last_rows = 0
        self._last_spec: dict[str, str] | None = None
        self.codec = codec
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._active: list[Job] = []
        self._sessions = SessionPool(
            engine.new_session,
            max_sessions=max_conversations,
            max_kv_bytes=engine.kv_budget_bytes,
            prompt_cache=prompt_cache,
        )
        self._layer_delay_s = layer_delay_s
        self._fail_prompt, self._fail_after = fail_prompt, max(1, fail_after)
        self._usage = usage or UsageSink()
        self._done = 0
        self._last_tok_s = 0.0
        self.store_view = self._store_view()

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
        """Take in the prompt cache saved by the last stop (before `serve` starts the
        engine thread); returns how many sessions were usable."""
        if not self._sessions.prompt_cache:
            return 0
        sessions = kv_files.load(directory, self.engine)
        self._sessions.adopt(sessions)
        return len(sessions)

    def save_prompt_cache(self, directory: Path) -> int:
        """Write the prompt cache for the next start (after the engine thread ended)."""
        if not self._sessions.prompt_cache:
            return 0
        return kv_files.save(self._sessions.cached_prompts(), directory, self.engine)

    def statistics(self) -> HostStatistics:
        return HostStatistics(
            len(self._active),
            len(self._sessions),
            self._done,
            self._last_tok_s,
            self._last_rows,
            self._last_spec,
        )

    # ---- engine thread ------------------------------------------------------------------
    def _thread_main(self) -> None:
        closing = False
        while not (closing and not self._active):
            try:
                item = self._inbox.get(block=not self._active and not closing, timeout=None)
            except queue.Empty:
                item = ...
            while item is not ...:
                if item is None:
                    closing = True
                    for job in self._active:
                        job.cancel_code = "SHUTTING_DOWN"
                        job.cancel.set()
                else:
                    self._handle(item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = ...
            if self._active:
                self._step()

    def _handle(self, item: Any) -> None:
        if isinstance(item, Job):
            self._begin(item)
        elif isinstance(item, tuple) and item[0] == "forget":
            self._sessions.forget_client(item[1])
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

    def _store_view(self) -> StoreView:
        store = self.engine.experts
        return StoreView(store.statistics(), frozenset(store.pinned_keys()))

    def publish_store(self) -> None:
        """Engine thread: refresh the snapshot `ps` and STATUS read."""
        self.store_view = self._store_view()

    def _finish(self, job: Job, event: Event) -> None:
        """Bookkeeping first, so a client that sees the end also sees the engine free. A
        request that failed after the engine ran for it gives its session up (KV rows and
        remembered logits): only finished (or cleanly cancelled) requests are kept."""
        if job in self._active:
            self._active.remove(job)
        if job in self._isolate:
            self._isolate.remove(job)
        if job.steps is not None:
            job.steps.close()
        job.forward = None
        if job.session_key is not None:
            failed = isinstance(event, Failed) and event.code not in CLEAN_ENDS
            self._sessions.checkin(job.session_key, discard=failed and job.ran)
            job.session_key = None
        self.publish_store()
        self._done += 1
        try:
            trio.from_thread.run_sync(job.on_finish)
        except trio.RunFinishedError:
            pass
        self._emit(job, event)

    def _begin(self, job: Job) -> None:
        try:
            ids = self._tokenize(job.request)
            if not ids:
                raise RequestError("the prompt renders to no tokens", code="EMPTY_PROMPT")
            if len(ids) >= self.engine.max_context:
                raise RequestError(
                    f"{len(ids)} {self.engine.max_context}: the prompt leaves no "
                    "room for a generated token",
                    code="CONTEXT_EXCEEDED",
                )
            job.session_key, session = self._sessions.checkout(
                job.request.client, job.request.conv, ids
            )
            job.cached = reusable_prefix(session, ids)
            detok = StreamingDetokenizer(self.codec) if self.codec else None
            stops = self.codec.stop_token_ids if self.codec else frozenset()
            job.steps = generation(
                self.engine,
                ids,
                job.request.params,
                stop_token_ids=stops,
                detokenizer=detok,
                cancel=job.cancel,
                session=session,
                speculate=self.speculate,
                costs=self._costs,
            )
            job.progress = self._progress_reporter(job)
        except ColibriError as exc:
            self._finish(job, Failed(exc.code, str(exc)))
            return
        except Exception as exc:  # a bug costs this request only
            log.exception("request %s failed to start", job.request.id)
            self._finish(job, Failed("INTERNAL", f"{type(exc).__name__}: {exc}"))
            return
        self._active.append(job)
        self._emit(job, Accepted(len(ids), job.cached))

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

    # ---- one engine step: every active request's next rows in one pass ----------------
    def _step(self) -> None:
        self._costs.sharing = len(self._active) - 1  # what a draft's rows ride beside
        ready = [job for job in list(self._active) if self._advance(job)]
        if not ready:
            return
        if self._isolate:  # a shared pass failed untraced: one request a pass until found
            suspect = next((job for job in self._isolate if job in ready), None)
            self._isolate.clear() if suspect is None else self._isolate.remove(suspect)
            ready = ready if suspect is None else [suspect]
        parts = self._compose(ready)
        chosen = {id(job) for job, _ in parts}
        for job in ready:  # prompts that wait for a later step still hear their cancel
            if id(job) not in chosen:
                self._cancelled_before(job)
        self._run_pass(parts)

    def _advance(self, job: Job) -> bool:
        """Run the job's generation until it asks for a pass (True) or ends (False),
        emitting its tokens on the way."""
        if job.forward is not None:
            return True
        assert job.steps is not None
        reply, job.reply = job.reply, None
        while True:
            try:
                if isinstance(reply, BaseException):
                    item = job.steps.throw(reply)
                else:
                    item = job.steps.send(reply)
            except StopIteration:
                self._finish(job, Failed("INTERNAL", "the generation ended without an answer"))
                return False
            except ColibriError as exc:
                self._finish(job, Failed(exc.code, str(exc)))
                return False
            except Exception as exc:
                log.exception("request %s failed", job.request.id)
                self._finish(job, Failed("INTERNAL", f"{type(exc).__name__}: {exc}"))
                return False
            reply = None
            if isinstance(item, Forward):
                try:
                    item = Forward(item.session, item.session.check(item.tokens), item.logits)
                except ColibriError as exc:
                    self._finish(job, Failed(exc.code, str(exc)))
                    return False
                job.forward, job.done_rows = item, 0
                return True
            if isinstance(item, TokenEvent):
                if item.text:
                    self._emit(job, Token(item.text))
                continue
            self._done_event(job, item)
            return False

    def _cancelled_before(self, job: Job) -> bool:
        """A request cancelled while it waits for its next pass leaves now, its session
        holding what it held before the pass it asked for (a prompt taken in chunks is
        given back whole)."""
        try:
            cancelled = job.cancel.is_set()
        except Exception as exc:  # an injected fault in the check itself
            job.ran = True
            self._finish(job, Failed("INTERNAL", f"{type(exc).__name__}: {exc}"))
            return True
        if not cancelled or job.forward is None:
            return False
        forward, rows = job.forward, job.done_rows
        if rows:
            forward.session.truncate(forward.session.length - rows)
        job.forward, job.reply = None, Cancelled("request cancelled")
        self._advance(job)  # the generation answers with its end
        return True

    def _compose(self, ready: list[Job]) -> list[tuple[Job, Forward]]:
        """Which rows run this step: every decode and verify whole; prompts whole when
        alone, else up to PREFILL_CHUNK tokens a step between them (in arrival order)."""
        parts: list[tuple[Job, Forward]] = []
        prompts: list[Job] = []
        for job in ready:
            assert job.forward is not None
            if job.forward.is_prompt:
                prompts.append(job)
            else:
                parts.append((job, job.forward))
        room = None if len(ready) == 1 else PREFILL_CHUNK
        for job in prompts:
            fwd = job.forward
            assert fwd is not None
            take = len(fwd.tokens) - job.done_rows
            if room is not None:
                take = min(take, room)
                room -= take
            if take <= 0:
                break
            parts.append((job, fwd.chunk(job.done_rows, job.done_rows + take)))
        return parts

    def _run_pass(self, parts: list[tuple[Job, Forward]]) -> None:
        jobs = [job for job, _ in parts]
        culprit: list[Job] = []
        hook = self._pass_hook(parts, culprit)
        rows = sum(len(f.tokens) for _, f in parts)
        store = self.engine.experts
        for job in jobs:
            job.ran = True
        t0 = time.perf_counter()
        try:
            outs = self.engine.run([f for _, f in parts], hook)
        except Cancelled:  # every request of the pass was cancelled: they leave now
            for job in jobs:
                self._cancelled_before(job)
            return
        except Exception as exc:
            self._failed_pass(jobs, culprit, exc)
            return
        finally:
            self._account_usage(jobs, store.take_usage())
            self.store_view = replace(self.store_view, stats=store.statistics())
        self._costs.observe(rows, time.perf_counter() - t0)
        if all(f.logits != LOGITS_NONE and len(f.tokens) <= 1 + 32 for _, f in parts):
            self._last_rows = rows
        for (job, part), out in zip(parts, outs, strict=True):
            job.done_rows += len(part.tokens)
            assert job.forward is not None
            if job.done_rows == len(job.forward.tokens):
                job.forward, job.reply = None, out

    def _pass_hook(
        self, parts: list[tuple[Job, Forward]], culprit: list[Job]
    ) -> Callable[[int], None]:
        """Before each layer: a pass whose every request is cancelled is abandoned (a lone
        request's cancel acts within a layer, as before batching); prompts report their
        progress. A check that raises (an injected fault) names its request."""
        layers = self.engine.info.n_layers
        prompts = [(job, part) for job, part in parts if job.forward and job.forward.is_prompt]

        def hook(index: int) -> None:
            live = False
            for job, _ in parts:
                try:
                    live = not job.cancel.is_set() or live
                except BaseException:
                    culprit.append(job)
                    raise
            if not live:
                raise Cancelled("request cancelled")
            for job, part in prompts:
                assert job.forward is not None and job.progress is not None
                total = len(job.forward.tokens)
                done = job.done_rows + len(part.tokens) * index / layers
                job.progress(int(layers * done / total), layers)

        return hook

    def _failed_pass(self, jobs: list[Job], culprit: list[Job], exc: Exception) -> None:
        """A pass raised and committed nothing: the request it is traced to fails; the
        others keep their next rows and run again, one request a pass when the fault
        could not be traced to one."""
        code = exc.code if isinstance(exc, ColibriError) else "INTERNAL"
        message = str(exc) if isinstance(exc, ColibriError) else f"{type(exc).__name__}: {exc}"
        blamed = culprit[:1] if culprit else (jobs if len(jobs) == 1 else [])
        if not blamed:
            log.warning(
                "a pass of %d requests failed (%s); running them one at a time", len(jobs), message
            )
            self._isolate.extend(job for job in jobs if job not in self._isolate)
            return
        if code == "INTERNAL":
            log.error("request %s failed: %s", blamed[0].request.id, message)
        for job in blamed:
            self._finish(job, Failed(code, message))

    def _account_usage(self, jobs: list[Job], delta: UsageDelta) -> None:
        """A pass's expert selections go to the usage profile of its requests (each
        profile once: requests of different profiles in one pass are all counted)."""
        for profile in dict.fromkeys(job.request.profile for job in jobs):
            self._usage.add(profile, delta)

    def _done_event(self, job: Job, event: DoneEvent) -> None:
        stats = event.stats
        self._last_tok_s = stats.decode_tok_s
        spec = _spec_extras(event.spec, self._costs)
        if spec is not None:
            self._last_spec = spec
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
            ),
        )


def _spec_extras(stats: SpecStats | None, costs: PassCosts) -> dict[str, str] | None:
    return None if stats is None else stats.extras(costs)


def _request_text(request: GenerateRequest) -> str:
    if request.messages is not None:
        return " ".join(str(m.get("content", "")) for m in request.messages)
    return request.prompt or ""
