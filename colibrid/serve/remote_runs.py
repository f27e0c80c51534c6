"""Requests for remote models: each a trio task streaming from its endpoint.

A remote model (`colibri pull URL`, colibrid.remote) computes elsewhere, so its requests
need none of the engine thread, the model slot or the admission queue in front of the
engine: `RemoteRunner` implements the scheduler's `Runs` seam with one task per request,
and the front ends (SERVE, every HTTP dialect) read the same events from it as from the
engine (`Accepted`, `Token`, then `Done` or `Failed`). So a remote model never loads,
unloads or waits for the local one, and the local one never waits for it.

The task posts the request (serve.remote_body) and turns the streamed chunks back into
text (remote.chunks). A CANCEL, a STOP or a client that leaves cancels the task's scope,
which closes the connection: the endpoint sees its request end. A failure of the
endpoint (unreachable, an error status, a timeout, a broken stream) ends that request
with one line (code REMOTE, or BAD_REQUEST for what the endpoint refused of it); the
daemon goes on. Each request ends with one log line naming the model and its URL (never
its key).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from colibri_protocol.errors import CODES

from colibrid.errors import ColibriError
from colibrid.paths import Paths
from colibrid.remote.chunks import ChunkReader
from colibrid.remote.client import HttpUpstream, Upstream
from colibrid.remote.keys import remote_key
from colibrid.remote.spec import RemoteSpec
from colibrid.serve.events import Accepted, Done, Event, Failed, Token, summary
from colibrid.serve.host import Job
from colibrid.serve.remote_body import remote_call
from colibrid.serve.requests import GenerateRequest
from colibrid.serve.scheduler import Handle, ServeError

log = logging.getLogger("colibrid.remote")
# httpx logs each request at INFO; the daemon's own line per request says more
logging.getLogger("httpx").setLevel(logging.WARNING)
logging.getLogger("httpcore").setLevel(logging.WARNING)


@dataclass
class RemoteStats:
    """One remote model as `colibri ps` shows it: where it is, and what it did here."""

    url: str
    model: str
    running: int = 0
    done: int = 0
    failed: int = 0
    last_tok_s: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "running": self.running,
            "requests_done": self.done,
            "failed": self.failed,
            "last_tok_s": round(self.last_tok_s, 2),
        }


class RemoteRunner:
    """The scheduler's `Runs` for remote models (see the module doc). `max_running`
    bounds the requests in flight to all endpoints together; more answer BUSY."""

    def __init__(self, paths: Paths, *, max_running: int, upstream: Upstream | None = None):
        self.paths = paths
        self.max_running = max_running
        self.upstream: Upstream = upstream or HttpUpstream()
        self.closing = False
        self.models: dict[str, RemoteStats] = {}  # by installed name, once used
        self._nursery: trio.Nursery | None = None
        self._scopes: dict[Job, trio.CancelScope] = {}
        self._running: set[Job] = set()
        self._open = 0
        self._settled = trio.Event()

    async def serve(
        self, *, task_status: trio.TaskStatus[RemoteRunner] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Hold the nursery the requests' tasks run in (never returns)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started(self)
            await trio.sleep_forever()

    # ---- Runs ------------------------------------------------------------------------------
    def submit_nowait(self, request: GenerateRequest) -> Handle:
        """Start `request` (its `remote` set) now, or raise ServeError (BUSY,
        SHUTTING_DOWN). The caller must then enter `track(handle)`."""
        spec = request.remote
        assert spec is not None and self._nursery is not None, "a prepared remote request"
        if self.closing:
            raise ServeError("the daemon is stopping", code="SHUTTING_DOWN")
        if len(self._running) >= self.max_running:
            raise ServeError(
                f"{len(self._running)} requests to remote models are in flight; try again later",
                code="BUSY",
            )
        send, receive = trio.open_memory_channel[Event](math.inf)
        job = Job(request, send, threading.Event())
        self._running.add(job)
        self._open += 1
        self._nursery.start_soon(self._run, job, spec)
        return Handle(self, job, receive)

    def cancel(self, job: Job) -> None:
        job.cancel.set()
        scope = self._scopes.get(job)
        if scope is not None:
            scope.cancel()

    @asynccontextmanager
    async def track(self, handle: Handle) -> AsyncIterator[Handle]:
        try:
            async with handle.events:
                yield handle
        finally:
            self.cancel(handle.job)
            self._open -= 1
            self._settled.set()

    # ---- the daemon's stop ----------------------------------------------------------------
    def close_nowait(self) -> None:
        """Refuse new requests (running ones go on)."""
        self.closing = True

    def cancel_running(self) -> None:
        """The shutdown grace ended: what still runs ends with SHUTTING_DOWN."""
        for job in list(self._running):
            job.cancel_code = "SHUTTING_DOWN"
            self.cancel(job)

    async def wait_idle(self) -> None:
        """Until every request has been answered and its context left."""
        while self._open:
            await self._settled.wait()
            self._settled = trio.Event()

    def statistics(self) -> dict[str, dict[str, Any]]:
        """STATUS's `remote`: each remote model used since the start."""
        return {name: stats.as_json() for name, stats in self.models.items()}

    # ---- one request ----------------------------------------------------------------------
    async def _run(self, job: Job, spec: RemoteSpec) -> None:
        stats = self.models.setdefault(spec.name, RemoteStats(spec.url, spec.model))
        stats.url, stats.model = spec.url, spec.model
        stats.running += 1
        clock = _Clock()
        reader = ChunkReader(chat=job.request.messages is not None)
        event: Event | None = None
        with trio.CancelScope() as scope:
            self._scopes[job] = scope
            if job.cancel.is_set():
                scope.cancel()
            event = await self._stream(job, spec, reader, clock)
        self._scopes.pop(job, None)
        if event is None:  # cancelled: a STOP keeps the answer so far
            if job.stop.is_set():
                self._emit(job, Token(reader.finish()))
                event = clock.done(reader, "stopped")
            else:
                why = "the daemon stopped" if job.cancel_code == "SHUTTING_DOWN" else "cancelled"
                event = Failed(job.cancel_code, f"{why} after {reader.pieces} pieces of text")
        self._running.discard(job)
        stats.running -= 1
        if isinstance(event, Done):
            stats.done += 1
            stats.last_tok_s = event.decode_tok_s
        else:
            stats.failed += 1
        log.info(
            "request %s client %d: remote %s (%s): %s",
            job.request.id,
            job.request.client,
            spec.name,
            spec.url,
            summary(event),
        )
        self._emit(job, event)

    async def _stream(
        self, job: Job, spec: RemoteSpec, reader: ChunkReader, clock: _Clock
    ) -> Event | None:
        """The request's text streamed onto its channel; its last event (None when it
        was cancelled)."""
        try:
            key = await trio.to_thread.run_sync(remote_key, self.paths, spec.name)
            route, body = remote_call(job.request, spec)
            async with self.upstream.open(spec, key, route, body) as chunks:
                self._emit(job, Accepted(0, 0))
                async with aclosing(chunks):
                    async for chunk in chunks:
                        text = reader.feed(chunk)
                        if text:
                            clock.token()
                            self._emit(job, Token(text))
            tail = reader.finish()
            if tail:
                self._emit(job, Token(tail))
            if reader.finish_reason == "length":
                return clock.done(reader, "length")
            # the stop string, where the endpoint says which (chunks.ChunkReader) and it is
            # one asked for; else None, read as the model's own end (docs/remote-models.md)
            said = reader.stop_string
            return clock.done(reader, "stop", said if said in job.request.params.stop else None)
        except ColibriError as exc:
            return Failed(exc.code if exc.code in CODES else "REMOTE", str(exc))
        except Exception as exc:  # a bug costs this request only
            log.exception("request %s to the remote model %s failed", job.request.id, spec.name)
            return Failed("INTERNAL", f"{type(exc).__name__}: {exc}")

    def _emit(self, job: Job, event: Event) -> None:
        """Put `event` on the job's channel; one nobody reads any more cancels the job."""
        if isinstance(event, Token) and not event.text:
            return
        try:
            job.send.send_nowait(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.cancel(job)


class _Clock:
    """A remote request's timings: the wait for its first text (the endpoint's prefill,
    and the way there) and the rest (its decode)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.first: float | None = None

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def done(self, reader: ChunkReader, finish: str, stop_string: str | None = None) -> Done:
        now = time.perf_counter()
        first = self.first or now
        prefill_s, decode_s = first - self.started, now - first
        usage = reader.usage
        generated = usage.completion_tokens or reader.pieces
        return Done(
            finish,
            usage.prompt_tokens,
            generated,
            usage.cached_tokens,
            prefill_s,
            decode_s,
            usage.prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
            max(generated - 1, 0) / decode_s if decode_s > 0 else 0.0,
            stop_string=stop_string,
        )
