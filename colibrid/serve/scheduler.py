"""Admission and fairness in front of the engine host.

Requests wait in one bounded queue per client and are admitted round-robin across
clients, so one chatty client cannot starve the others; at most `max_active` run at
once (the host interleaves them token by token). A full queue fails fast with BUSY.
`submit` is an async context manager yielding the request's event channel; leaving it
early cancels the request (queued: removed; running: its cancel flag is set).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import trio

from colibrid.errors import ColibriError
from colibrid.serve.events import Event, Failed
from colibrid.serve.host import EngineHost, Job
from colibrid.serve.requests import GenerateRequest


class ServeError(ColibriError):
    """A request refused before it runs (BUSY, SHUTTING_DOWN)."""


@dataclass(frozen=True)
class SchedulerStatistics:
    queued: int
    running: int
    max_queue: int
    max_active: int


class Runs(Protocol):
    """Who runs submitted requests: the `Scheduler` (the engine thread) or the remote
    runner (serve.remote_runs: a trio task each, for a remote model)."""

    def cancel(self, job: Job) -> None:
        """End the job (queued: removed; running: stopped within a token)."""
        ...

    def track(self, handle: Handle) -> AbstractAsyncContextManager[Handle]:
        """Leaving this context (normally, by error or by cancellation) ends the request."""
        ...


class Handle:
    """What a front end holds for one submitted request."""

    def __init__(self, runs: Runs, job: Job, events: trio.MemoryReceiveChannel[Event]) -> None:
        self.runs = runs
        self.job = job
        self.events = events

    def cancel(self) -> None:
        self.runs.cancel(self.job)

    def track(self) -> AbstractAsyncContextManager[Handle]:
        """`track` of whoever runs it."""
        return self.runs.track(self)

    def stop(self) -> None:
        """Graceful end: the answer so far is kept and DONE follows."""
        self.job.stop.set()
        self.cancel()


class Scheduler:
    def __init__(self, host: EngineHost, *, max_queue: int = 16, max_active: int = 4) -> None:
        self.host = host
        self.max_queue = max_queue
        self.max_active = max_active
        self._pending: OrderedDict[int, deque[Job]] = OrderedDict()
        self._queued = 0
        self._running: set[Job] = set()
        self._open = 0
        self._changed = trio.Event()  # wakes the dispatcher
        self._settled = trio.Event()  # wakes wait_idle
        self._slots = trio.Semaphore(max_active)
        self.closing = False
        self.on_finished: Callable[[Job], None] | None = None  # after each request ends

    async def serve(
        self, *, task_status: trio.TaskStatus[Scheduler] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Dispatch queued jobs to the host as slots free up (never returns)."""
        task_status.started(self)
        while True:
            await self._slots.acquire()
            while not self._queued:
                await self._changed.wait()
                self._changed = trio.Event()
            job = self._pop_fair()
            self._running.add(job)
            job.on_finish = lambda job=job: self._finished(job)
            self.host.start(job)

    def submit_nowait(
        self, request: GenerateRequest, *, same_prompt_as: Handle | None = None
    ) -> Handle:
        """Queue `request` now (so one connection's requests keep their order) or raise
        ServeError (BUSY, SHUTTING_DOWN). The caller must then enter `track(handle)`.

        `same_prompt_as`: a request submitted before with the same prompt ids (another
        choice of one OpenAI `n` request); this one then starts from a copy of that one's
        prompt KV once it is computed, instead of prefilling the prompt again (serve.host).
        """
        if same_prompt_as is not None:
            first = same_prompt_as.job.request
            if request.prompt_ids is None or request.prompt_ids != first.prompt_ids:
                raise ValueError("a request shares the prompt of one with the same prompt ids")
            if request.conv is not None:
                raise ValueError("a request of a conversation starts from that conversation")
        if self.closing:
            raise ServeError("the daemon is stopping", code="SHUTTING_DOWN")
        if self._queued >= self.max_queue:
            raise ServeError(
                f"the queue is full ({self._queued} requests waiting); try again later", code="BUSY"
            )
        send, receive = trio.open_memory_channel[Event](math.inf)
        leader = None if same_prompt_as is None else same_prompt_as.job
        job = Job(request, send, self.host.new_cancel_flag(request), leader=leader)
        self._pending.setdefault(request.client, deque()).append(job)
        self._queued += 1
        self._open += 1
        self._wake()
        return Handle(self, job, receive)

    @asynccontextmanager
    async def track(self, handle: Handle) -> AsyncIterator[Handle]:
        """Leaving this context (normally, by error or by cancellation) ends the request."""
        try:
            async with handle.events:
                yield handle
        finally:
            self._cancel(handle.job, notify=False)
            self._open -= 1
            self._wake()

    @asynccontextmanager
    async def submit(self, request: GenerateRequest) -> AsyncIterator[Handle]:
        """`submit_nowait` + `track`: yields the handle whose `events` channel streams."""
        async with self.track(self.submit_nowait(request)) as handle:
            yield handle

    def cancel(self, job: Job) -> None:
        """`Runs.cancel`: a queued job is told CANCELLED and removed, a running one's
        cancel flag is set."""
        self._cancel(job)

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            self._queued, len(self._running), self.max_queue, self.max_active
        )

    def close_nowait(self) -> None:
        """Refuse new requests and fail the queued ones (running ones go on)."""
        self.closing = True
        for jobs in list(self._pending.values()):
            for job in list(jobs):
                self._cancel(job, message="the daemon is stopping", code="SHUTTING_DOWN")

    def cancel_running(self) -> None:
        """The shutdown grace ended: what still runs ends with SHUTTING_DOWN."""
        for job in list(self._running):
            job.cancel_code = "SHUTTING_DOWN"
            job.cancel.set()

    async def wait_idle(self) -> None:
        """Until every submitted request has been answered and its context left."""
        while self._open:
            await self._settled.wait()
            self._settled = trio.Event()

    # ---- internals ----------------------------------------------------------------------
    def _wake(self) -> None:
        self._changed.set()
        self._settled.set()

    def _pop_fair(self) -> Job:
        client, jobs = next(iter(self._pending.items()))
        job = jobs.popleft()
        self._queued -= 1
        del self._pending[client]
        if jobs:
            self._pending[client] = jobs  # to the back of the round
        return job

    def _cancel(
        self,
        job: Job,
        *,
        notify: bool = True,
        message: str = "cancelled",
        code: str = "CANCELLED",
    ) -> None:
        queue = self._pending.get(job.request.client)
        if queue is not None and job in queue:
            queue.remove(job)
            self._queued -= 1
            if not queue:
                del self._pending[job.request.client]
            if notify:
                try:
                    job.send.send_nowait(Failed(code, f"{message} while queued"))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            return
        job.cancel.set()

    def _finished(self, job: Job) -> None:
        self._running.discard(job)
        self._slots.release()
        self._wake()
        if self.on_finished is not None:
            self.on_finished(job)
