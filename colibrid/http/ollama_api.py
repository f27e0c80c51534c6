"""Ollama's native API on the daemon's HTTP server (``/api/...``), beside the OpenAI and
Anthropic ones and behind the same gate (Host, Origin, API key): the routes, and the I/O
around the pure translators (`ollama` for generation, `ollama_models` for the model
endpoints, `installs` for pull and delete).

A generation goes the way every other HTTP one does (the app's `_ensure`, `_prepare`,
`_generate`: one queue, one engine); only the framing differs, newline-delimited JSON
(`ndjson`), Ollama's default, with ``{"error": …}`` as an error's line once a stream has
begun. Errors before that are HTTP errors with Ollama's body, ``{"error": "<message>"}``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any, Protocol

import trio

from colibrid.errors import RequestError
from colibrid.http import installs, ndjson, ollama, ollama_models
from colibrid.http.body import Decoder, decode_json
from colibrid.http.errors import ApiError, bad_request, from_code
from colibrid.http.metrics import HttpMetrics
from colibrid.http.openai import Plan
from colibrid.http.parsing import Features
from colibrid.installed import Installed, describe, installed
from colibrid.serve.events import Accepted, Done, Failed, Token
from colibrid.serve.state import GB, rss_gb

EMBEDDINGS_REFUSED = (
    "embeddings are not supported: colibri serves generative models, whose hidden states "
    "are not trained as embeddings (an embedding model gives them)"
)


class Responding(Protocol):
    """The response side of one exchange (app.Responder)."""

    status: int

    async def start(self, status: int, headers: tuple[tuple[bytes, bytes], ...]) -> None: ...

    async def body(self, data: bytes, *, more: bool = True) -> None: ...

    async def full(self, status: int, data: bytes) -> None: ...

    async def json(self, status: int, obj: Any) -> None: ...


Pump = Callable[[Plan, Any, Any, Responding], Awaitable[None]]


class AppSide(Protocol):
    """What this layer uses of the HTTP app (app.HttpApp): the daemon's state, the body
    decoder, and the steps every generation takes."""

    state: Any
    decoder: Decoder
    metrics: HttpMetrics
    _clients: Iterator[int]

    @property
    def max_context(self) -> int: ...

    @property
    def features(self) -> Features: ...

    def context_of(self, model: str) -> int: ...

    def features_of(self, model: str) -> Features: ...

    def _installed(self) -> list[str]: ...

    async def _ensure(self, model: str) -> None: ...

    async def _prepare(self, plan: Plan) -> Plan: ...

    async def _generate(
        self, plan: Plan, translator: Any, receive: Any, responder: Any, pump: Pump | None = None
    ) -> None: ...


class OllamaApi:
    PREFIX = "/api/"
    ROUTES = {
        "/api/version": "GET",
        "/api/tags": "GET",
        "/api/ps": "GET",
        "/api/show": "POST",
        "/api/chat": "POST",
        "/api/generate": "POST",
        "/api/pull": "POST",
        "/api/delete": "DELETE",
        "/api/embed": "POST",
        "/api/embeddings": "POST",
    }

    def __init__(self, app: AppSide) -> None:
        self.app = app
        self.state = app.state

    async def route(self, path: str, data: bytes | None, receive: Any, responder: Any) -> None:
        state = self.state
        if path == "/api/version":
            await responder.json(200, ollama_models.version(state.version))
        elif path == "/api/tags":
            await responder.json(200, ollama_models.tags(await self._models()))
        elif path == "/api/ps":
            await responder.json(200, await self._ps())
        elif path in ("/api/embed", "/api/embeddings"):
            raise ApiError(501, EMBEDDINGS_REFUSED, code="not_implemented")
        else:
            assert data is not None
            body = await self.app.decoder.run(len(data), lambda: decode_json(data))
            if path == "/api/show":
                await responder.json(200, await self._show(body))
            elif path == "/api/pull":
                await self._pull(body, responder)
            elif path == "/api/delete":
                await installs.delete(state, body)
                await responder.full(200, b"")
            else:
                await self._generate(path, body, len(data), receive, responder)

    # ---- the model endpoints ------------------------------------------------------------
    async def _models(self) -> list[Installed]:
        """The installed models and the loaded one (a folder outside models/ too)."""
        models = self.state.models
        current = models.current

        def scan() -> list[Installed]:
            found = installed(models.paths)
            if current is not None and current.name not in {m.name for m in found}:
                loaded = describe(current.name, current.path)
                found = ([loaded] if loaded is not None else []) + found
            return found

        return await trio.to_thread.run_sync(scan)

    async def _show(self, body: Any) -> dict[str, Any]:
        name = ollama.model_name(body, self.app._installed())
        model = next(m for m in await self._models() if m.name == name)
        return ollama_models.show(body, model)

    async def _ps(self) -> dict[str, Any]:
        models = self.state.models
        current = models.current
        entry = None
        if current is not None:
            entry = await trio.to_thread.run_sync(lambda: describe(current.name, current.path))
        vram = self.state.tiers()["vram"].get("weights_gb", 0.0)
        return ollama_models.ps(
            entry,
            memory_bytes=round(rss_gb() * GB),
            vram_bytes=round(vram * GB),
            context=self.app.max_context,
            unload_in_s=models.unload_in(),
            keep_alive_s=models.keep_alive_s,
        )

    async def _pull(self, body: Any, responder: Any) -> None:
        name, stream = installs.pull_request(body)
        lines = installs.pull(name)
        try:
            first = await anext(lines)  # a pull that fails at once raises here: an HTTP error
            if not stream:
                async for line in lines:
                    first = line
                await responder.json(200, first)
                return
            await responder.start(200, ndjson.HEADERS)
            await responder.body(ndjson.line(first))
            try:
                async for line in lines:
                    await responder.body(ndjson.line(line))
            except ApiError as exc:
                await responder.body(ndjson.line(ollama.error_line(exc)), more=False)
                return
            await responder.body(b"", more=False)
        finally:
            await lines.aclose()

    # ---- generation -----------------------------------------------------------------------
    async def _generate(
        self, path: str, body: Any, size: int, receive: Any, responder: Any
    ) -> None:
        app = self.app
        started = time.perf_counter_ns()
        model = ollama.model_name(body, app._installed())
        if ollama.only_loads(path, body) and await self._unloads(model, body):
            await responder.json(200, ollama.loaded(path, model, "unload", 0, started))
            return
        await app._ensure(model)
        load_ns = time.perf_counter_ns() - started
        if ollama.only_loads(path, body):
            if self.state.remote(model) is None:  # a remote model has nothing to keep
                self.state.models.hold(ollama.keep_alive(body))
            await responder.json(200, ollama.loaded(path, model, "load", load_ns, started))
            return
        client = next(app._clients)
        exchange = await app.decoder.run(size, lambda: self._plan(path, body, client, model))
        plan = ollama.within(await app._prepare(exchange.plan), exchange.num_ctx)
        translator = ollama.Stream(
            replace(exchange, plan=plan), started_ns=started, load_ns=load_ns
        )
        await app._generate(plan, translator, receive, responder, self._pump)

    async def _unloads(self, model: str, body: dict[str, Any]) -> bool:
        """``keep_alive: 0`` with nothing to answer: the model is unloaded now (if it is
        the one loaded; busy, it is a 503 as any unload of a busy model)."""
        if ollama.keep_alive(body) != 0:
            return False
        if self.state.model_name == model:
            await self.state.models.unload("keep_alive 0 over the Ollama API")
        return True

    def _plan(self, path: str, body: Any, client: int, model: str) -> ollama.Exchange:
        """Pure, so it may run in a worker thread."""
        try:
            return ollama.plan(
                path,
                body,
                served=model,
                client=client,
                max_context=self.app.context_of(model),
                features=self.app.features_of(model),
            )
        except RequestError as exc:  # a grammar past the caps, beyond the named fields
            raise bad_request(str(exc)) from None

    async def _pump(
        self, plan: Plan, translator: ollama.Stream, events: Any, responder: Responding
    ) -> None:
        """The events as NDJSON lines (or one object when not streaming)."""
        first = await events.receive()
        if isinstance(first, Failed):
            raise from_code(first.code, first.message, max_context=self.app.max_context)
        assert isinstance(first, Accepted)
        if plan.stream:
            await responder.start(200, ndjson.HEADERS)
        async for event in events:
            if isinstance(event, Token):
                items = translator.token(event)
                if plan.stream and items:
                    await responder.body(ndjson.lines(items))
            elif isinstance(event, Done):
                self.app.metrics.finished(event)
                if not plan.stream:
                    await responder.json(200, translator.response(event))
                else:
                    await responder.body(ndjson.lines(translator.finish(event)), more=False)
                return
            elif isinstance(event, Failed):
                error = from_code(event.code, event.message, max_context=self.app.max_context)
                if not plan.stream:
                    raise error
                await responder.body(ndjson.line(ollama.error_line(error)), more=False)
                return
