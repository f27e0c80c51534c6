"""The ASGI app (routes, browser rules, API key, CORS, error bodies) and `serve_http`, which
runs it with hypercorn's trio worker inside the daemon nursery.

Every request passes `Gate` (Host / Origin) before anything else, then the route, the
key and, for POST, `require_json`; bodies are read and decoded by `colibrid.http.body`.

Every generation goes through `state.submit_nowait` + `handle.track()`, exactly like a
SERVE session: the queue, fairness, cancellation and the engine thread are shared (and a
remote model's requests go to its endpoint the same way: serve.remote_runs).
The response status is chosen only after the request is `Accepted` (or refused), so
admission and context errors are real HTTP errors even for streaming requests. A task
per request waits for ``http.disconnect`` and cancels the request's scope: leaving
`track` sets the cancel flag, which frees the engine within one token.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import logging
import math
import socket
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any

import trio

from colibrid.errors import ColibriError, ConfigError, RequestError, contain_panics
from colibrid.http import anthropic, dashboard, errors, openai, sse
from colibrid.http.body import Decoder, decode_json, read_body
from colibrid.http.choices import Choices, choice_request
from colibrid.http.errors import ApiError, bad_request
from colibrid.http.gate import Gate, is_loopback_host, require_json
from colibrid.http.metrics import CONTENT_TYPE, HttpMetrics
from colibrid.http.ollama_api import OllamaApi
from colibrid.http.openapi import describe
from colibrid.http.parsing import REMOTE_FEATURES, Features
from colibrid.http.response_events import ResponseStream
from colibrid.http.response_store import ResponseStore
from colibrid.http.responses import response_plan
from colibrid.installed import names as installed_names
from colibrid.serve.events import Accepted, Done, Failed, Progress, Token
from colibrid.serve.prepare import GrammarRefused, tokenize
from colibrid.serve.remote_body import OPEN_CONTEXT
from colibrid.serve.requests import GenerateRequest

log = logging.getLogger("colibrid.http")
JSON = (b"content-type", b"application/json")
ROUTES = {
    "/health": "GET",
    "/metrics": "GET",
    "/openapi.json": "GET",
    "/v1/models": "GET",
    "/v1/chat/completions": "POST",
    "/v1/completions": "POST",
    "/v1/messages": "POST",
    **OllamaApi.ROUTES,
    "/v1/responses": "POST",
    "/v1/messages/count_tokens": "POST",
    **dashboard.ROUTES,  # the page at / and its JSON endpoints
}
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
# frames one request's events as its dialect streams them: (plan, translator, events, responder)
Pump = Callable[[Any, Any, Any, Any], Awaitable[None]]


class Responder:
    """The response side of one exchange: remembers whether headers went out."""

    def __init__(self, send: Send, extra: list[tuple[bytes, bytes]]) -> None:
        self._send = send
        self.extra = extra
        self.status = 0

    async def start(self, status: int, headers: tuple[tuple[bytes, bytes], ...]) -> None:
        self.status = status
        await self._send(
            {"type": "http.response.start", "status": status, "headers": [*headers, *self.extra]}
        )

    async def body(self, data: bytes, *, more: bool = True) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def full(
        self,
        status: int,
        data: bytes,
        content_type: bytes = JSON[1],
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        await self.start(
            status,
            ((b"content-type", content_type), *((k.encode(), v.encode()) for k, v in headers)),
        )
        await self.body(data, more=False)

    async def json(self, status: int, obj: Any) -> None:
        await self.full(status, json.dumps(obj, ensure_ascii=False).encode())


class HttpApp:
    def __init__(self, state: Any, settings: Any) -> None:
        self.state = state
        self.settings = settings
        self.metrics = HttpMetrics(state)
        self._features: tuple[str | None, Features] = (None, Features())
        origins = [o.strip() for o in (settings.http_cors or "").split(",") if o.strip()]
        self.cors = origins
        self.gate = Gate(
            keyed=bool(settings.http_api_key), cors=origins, bound=bound_host(settings.http)
        )
        self.decoder = Decoder()
        self.responses = ResponseStore()  # `store` / `previous_response_id` (/v1/responses)
        self.ollama = OllamaApi(self)  # Ollama's native API (/api/...)
        self._clients = itertools.count(1 << 40)  # never collides with SERVE connection ids

    @property
    def max_context(self) -> int:
        engine = self.state.engine
        return int(engine.max_context) if engine is not None else 0

    def context_of(self, model: str) -> int:
        """The context a request for `model` is planned with: the loaded model's, or for
        a remote one, none known here (serve.remote_body.OPEN_CONTEXT)."""
        return OPEN_CONTEXT if self.state.remote(model) is not None else self.max_context

    def features_of(self, model: str) -> Features:
        """What a request for `model` may ask of its answer: the loaded model's chat
        template's features, or for a remote one `REMOTE_FEATURES`."""
        return REMOTE_FEATURES if self.state.remote(model) is not None else self.features

    @property
    def features(self) -> Features:
        """What the loaded model's chat template supports (tools, thinking), per model."""
        name = self.state.model_name
        if self._features[0] != name:
            codec = self.state.host.codec
            templates = codec.chat_templates if codec is not None else None
            prompt = codec.generation_prompt() if codec is not None else None
            specials = codec.special_token_names() if codec is not None else frozenset()
            self._features = (name, Features.of_template(templates, prompt, specials))
        return self._features[1]

    def _installed(self) -> list[str]:
        """What a request may name: the installed models, and the loaded one (which may be
        a folder outside models/, started with `--model DIR`)."""
        names = installed_names(self.state.models.paths)
        current = self.state.model_name
        return names if current is None or current in names else [current, *names]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] == "http":
            await self.handle(scope, receive, send)

    # ---- one exchange -------------------------------------------------------------------
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        responder = Responder(send, self._cors_headers(scope))
        route = path if path in ROUTES or not path.startswith("/v1/models/") else "/v1/models/"
        try:
            headers = dict(scope["headers"])
            self.gate.check(headers)
            if method == "OPTIONS" and responder.extra:
                await responder.full(
                    204,
                    b"",
                    headers=(
                        ("access-control-allow-methods", "GET, POST, DELETE, OPTIONS"),
                        (
                            "access-control-allow-headers",
                            "authorization, content-type, x-api-key, anthropic-version",
                        ),
                        ("access-control-max-age", "600"),
                    ),
                )
                return
            want = ROUTES.get(path, "GET" if route == "/v1/models/" else None)
            if want is None:
                raise ApiError(404, f"no route {path}", code="not_found")
            if method != want:
                raise ApiError(
                    405,
                    f"{path} takes {want}, not {method}",
                    code="method_not_allowed",
                    headers=(("allow", f"{want}, OPTIONS" if self.cors else want),),
                )
            # the page's files hold no data, and a browser cannot send a key to load them
            if path != "/health" and path not in dashboard.ASSETS:
                self._authorize(scope)
            data = None
            if want in ("POST", "DELETE"):  # Ollama's /api/delete has a JSON body
                require_json(headers)
                data = await read_body(
                    receive,
                    headers,
                    limit=self.settings.http_max_body_bytes,
                    timeout_s=self.settings.http_body_timeout_s,
                )
            with contain_panics("a native library"):
                await self._route(path, data, receive, responder)
        except ApiError as exc:
            await self._fail(responder, exc, anthropic=path.startswith("/v1/messages"), path=path)
        except ColibriError as exc:  # a native panic, contained
            log.error("HTTP %s %s failed: %s", method, path, exc)
            await self._fail(
                responder,
                errors.from_code(exc.code, str(exc)),
                anthropic=path.startswith("/v1/messages"),
                path=path,
            )
        except Exception as exc:  # a bug costs this request only
            log.exception("HTTP %s %s failed", method, path)
            await self._fail(
                responder,
                ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error"),
                path=path,
            )
        finally:
            self.metrics.requests.labels(
                route if route in ROUTES or route == "/v1/models/" else "other",
                str(responder.status or 499),
            ).inc()

    async def _fail(
        self, responder: Responder, exc: ApiError, *, anthropic: bool = False, path: str = ""
    ) -> None:
        if responder.status:  # headers are out: the stream can only end
            return
        data = (
            exc.ollama_bytes()
            if path.startswith(OllamaApi.PREFIX)
            else exc.json_bytes(anthropic=anthropic)
        )
        try:
            await responder.full(exc.status, data, headers=exc.headers)
        except Exception:  # the client is gone
            pass

    def _cors_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        if not self.cors:
            return []
        origin = dict(scope["headers"]).get(b"origin", b"").decode("latin-1")
        if "*" in self.cors:
            return [(b"access-control-allow-origin", b"*")]
        if origin in self.cors:
            return [(b"access-control-allow-origin", origin.encode()), (b"vary", b"origin")]
        return []

    def _authorize(self, scope: Scope) -> None:
        key = self.settings.http_api_key
        if not key:
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        token = given[7:].strip() if given[:7].lower() == "bearer " else None
        if token is None:
            token = headers.get(b"x-api-key", b"").decode("latin-1") or None
        if token != key:
            raise ApiError(
                401,
                "missing or invalid API key (send `Authorization: Bearer KEY`)",
                code="invalid_api_key",
            )

    async def _route(
        self, path: str, data: bytes | None, receive: Receive, responder: Responder
    ) -> None:
        state = self.state
        if path == "/health":
            await responder.json(200, {"status": "ok", "model": state.model_name})
        elif path == "/metrics":
            await responder.full(200, self.metrics.render(), CONTENT_TYPE.encode())
        elif path == "/openapi.json":
            await responder.json(200, describe(state.model_name or "MODEL"))
        elif path == "/v1/models":
            names = self._installed()
            await responder.json(200, openai.models_list(names, int(state.started)))
        elif path.startswith("/v1/models/"):
            name = path[len("/v1/models/") :]
            openai.known_model(name, self._installed())
            await responder.json(200, openai.model_card(name, int(state.started)))
        elif path in dashboard.ASSETS:
            page, content_type = dashboard.asset(path)
            await responder.full(200, page, content_type.encode(), dashboard.ASSET_HEADERS)
        elif path == dashboard.STATUS_PATH:
            await responder.json(200, dashboard.snapshot(state))
        elif path == dashboard.PROFILE_PATH:
            assert data is not None
            body = await self.decoder.run(len(data), lambda: decode_json(data))
            await responder.json(200, await dashboard.use_profile(state, body))
        elif path.startswith(OllamaApi.PREFIX):
            await self.ollama.route(path, data, receive, responder)
        else:
            assert data is not None
            client = next(self._clients)
            body = await self.decoder.run(len(data), lambda: decode_json(data))
            model = openai.check_model(body, self._installed())
            await self._ensure(model)
            plan, translator = await self.decoder.run(
                len(data), lambda: self._plan(path, body, client, model)
            )
            if path == "/v1/messages/count_tokens":
                await responder.json(200, {"input_tokens": await self._count(plan)})
                return
            plan = await self._prepare(plan)
            if plan.n > 1:
                await self._generate_many(plan, translator, receive, responder)
            else:
                await self._generate(plan, translator, receive, responder)

    async def _count(self, plan: openai.Plan) -> int:
        """The tokens of the plan's prompt, rendered and tokenised as a generation's is
        (serve.prepare.tokenize), in a worker thread; nothing is generated."""
        if self.state.remote(plan.model) is not None:
            raise bad_request(
                f"{plan.model} is a remote model: its endpoint's tokenizer is not here to "
                "count with (OpenAI's API has no count of its own)",
                "model",
            )
        codec = self.state.host.codec
        if codec is None:
            raise bad_request("this model has no tokenizer.json; it cannot count text")
        try:
            ids = await trio.to_thread.run_sync(tokenize, codec, plan.request)
        except ColibriError as exc:
            raise errors.from_code(exc.code, str(exc), max_context=self.max_context) from None
        return len(ids)

    async def _ensure(self, model: str) -> None:
        """The model a request names is loaded (in place of another when idle)."""
        try:
            await self.state.ready(model)  # a remote model: nothing to load
        except ColibriError as exc:
            raise errors.from_code(
                exc.code, str(exc), retry_after_s=self.settings.http_retry_after_s
            ) from None

    def _plan(self, path: str, body: Any, client: int, model: str) -> tuple[openai.Plan, Any]:
        """Body -> (Plan, translator); pure, so it may run in a worker thread."""
        try:
            return self._plan_of(path, body, client, model)
        except RequestError as exc:  # a grammar past the caps, beyond the named fields
            raise bad_request(str(exc)) from None

    def _plan_of(self, path: str, body: Any, client: int, model: str) -> tuple[openai.Plan, Any]:
        common = {"served": model, "client": client, "max_context": self.context_of(model)}
        features = self.features_of(model)
        if path == "/v1/chat/completions":
            plan = openai.chat_plan(body, features=features, **common)
            return plan, _translator(plan, openai.ChatStream)
        if path == "/v1/completions":
            plan = openai.completion_plan(body, **common)
            return plan, _translator(plan, openai.CompletionStream)
        if path == "/v1/responses":
            plan, spec = response_plan(body, features=features, store=self.responses, **common)
            return plan, ResponseStream(plan, spec, self.responses)
        if path == "/v1/messages/count_tokens":
            plan = anthropic.count_plan(body, features=features, **common)
            return plan, None
        plan = anthropic.messages_plan(body, features=features, **common)
        return plan, anthropic.MessageStream(plan)

    async def _prepare(self, plan: openai.Plan) -> openai.Plan:
        """The plan's request tokenised and its grammar compiled, off this loop
        (serve.prepare): each schema the client gave is compiled first by itself, so that
        a bad one is a 400 naming its field (one that is the whole grammar, a response
        format alone, is compiled once, as the grammar)."""
        if self.state.remote(plan.model) is not None:  # the endpoint checks its schemas
            try:
                return replace(plan, request=await self.state.prepare(plan.request, plan.model))
            except ColibriError as exc:
                raise errors.from_code(exc.code, str(exc)) from None
        grammar = plan.request.grammar
        itself = next((c for c in plan.checks if grammar and c.grammar.key == grammar.key), None)
        for check in plan.checks:
            if check is itself:
                continue
            try:
                await self.state.grammars.check(check.grammar)
            except RequestError as exc:
                raise bad_request(f"{check.where}: {exc}", check.param) from None
        try:
            request = await self.state.prepare(plan.request)
        except GrammarRefused as exc:
            if itself is None:
                raise bad_request(str(exc)) from None
            raise bad_request(f"{itself.where}: {exc}", itself.param) from None
        except ColibriError as exc:
            raise errors.from_code(exc.code, str(exc), max_context=self.max_context) from None
        return replace(plan, request=request)

    # ---- generation -----------------------------------------------------------------------
    async def _generate(
        self,
        plan: openai.Plan,
        translator: Any,
        receive: Receive,
        responder: Responder,
        pump: Pump | None = None,
    ) -> None:
        """Submit and track one request; `pump` frames its events (default: SSE)."""
        pump = pump or self._pump
        try:
            handle = self.state.submit_nowait(plan.request)
        except ColibriError as exc:
            raise errors.from_code(
                exc.code, str(exc), retry_after_s=self.settings.http_retry_after_s
            ) from None
        failure: list[ApiError] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope)
            try:
                async with handle.track():
                    await pump(plan, translator, handle.events, responder)
            except ApiError as exc:
                failure.append(exc)
            nursery.cancel_scope.cancel()
        if failure:
            raise failure[0]

    async def _pump(
        self, plan: openai.Plan, translator: Any, events: Any, responder: Responder
    ) -> None:
        first = await events.receive()
        if isinstance(first, Failed):
            raise errors.from_code(first.code, first.message, max_context=self.max_context)
        assert isinstance(first, Accepted)
        # A max_tokens past the context is clamped to what is left, as llama-server and the
        # SERVE protocol do (the answer then ends with finish_reason "length"): many clients
        # send a large max_tokens by default. A prompt that leaves no room fails (above).
        anthropic_api = isinstance(translator, anthropic.MessageStream)
        responses_api = isinstance(translator, ResponseStream)  # named events, no [DONE]
        encode = _encoder(anthropic_api or responses_api)
        if plan.stream:
            await responder.start(200, sse.HEADERS)
            head = (
                translator.start(first.prompt_tokens, first.cached_tokens)
                if anthropic_api
                else translator.start()
            )
            if head:
                await responder.body(encode(head))
        async for event in events:
            if isinstance(event, Progress):
                if plan.stream:  # a long prefill: show life (Anthropic's own keep-alive is ping)
                    await responder.body(
                        sse.named("ping", {})
                        if anthropic_api
                        else sse.comment(f"prefill {event.done}/{event.total}")
                    )
            elif isinstance(event, Token):
                items = (
                    translator.token(event.text)
                    if event.logprobs is None
                    else translator.token(event.text, event.logprobs)
                )
                if plan.stream and items:
                    await responder.body(encode(items))
            elif isinstance(event, Done):
                self.metrics.finished(event)
                if not plan.stream:
                    await responder.json(200, translator.response(event))
                    return
                tail = encode(translator.finish(event))
                named = anthropic_api or responses_api
                await responder.body(tail if named else tail + sse.DONE, more=False)
                return
            elif isinstance(event, Failed):
                error = errors.from_code(event.code, event.message, max_context=self.max_context)
                if not plan.stream:
                    raise error
                payload = error.body(anthropic=anthropic_api)
                if responses_api:  # response.failed, carrying the error
                    data = encode(translator.failed(payload["error"]))
                elif anthropic_api:
                    data = sse.named("error", {"error": payload["error"]})
                else:
                    data = sse.data(payload)
                await responder.body(data, more=False)
                return

    # ---- n > 1 (http.choices) ----------------------------------------------------------------
    async def _choice(self, plan: openai.Plan, i: int) -> GenerateRequest:
        """Choice i's request, ready for the engine: the prompt's ids are shared; a grammar's
        matcher holds one answer's state, so a constrained choice gets its own."""
        request = choice_request(plan.request, i)
        if i == 0 or request.constraint is None:
            return request
        try:
            return await self.state.prepare(
                replace(request, prompt_ids=None, constraint=None), plan.model
            )
        except ColibriError as exc:
            raise errors.from_code(exc.code, str(exc), max_context=self.max_context) from None

    async def _generate_many(
        self, plan: openai.Plan, choices: Choices, receive: Receive, responder: Responder
    ) -> None:
        """`n` requests, submitted and tracked together; a refusal of any ends them all.
        The first computes the prompt; the others start from a copy of its KV
        (`same_prompt_as`: the prompt is prefilled once)."""
        requests = [await self._choice(plan, i) for i in range(plan.n)]
        failure: list[ApiError] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope)
            try:
                async with AsyncExitStack() as stack:
                    handles = []
                    for request in requests:
                        try:
                            handle = self.state.submit_nowait(
                                request, same_prompt_as=handles[0] if handles else None
                            )
                        except ColibriError as exc:
                            raise errors.from_code(
                                exc.code, str(exc), retry_after_s=self.settings.http_retry_after_s
                            ) from None
                        handles.append(await stack.enter_async_context(handle.track()))
                    error = await self._pump_many(plan, choices, handles, responder)
                    if error is not None:
                        raise error
            except ApiError as exc:
                failure.append(exc)
            nursery.cancel_scope.cancel()
        if failure:
            raise failure[0]

    async def _pump_many(
        self, plan: openai.Plan, choices: Choices, handles: list[Any], responder: Responder
    ) -> ApiError | None:
        """The choices' events, merged as they come; an error before the response started
        is returned (the caller raises it), one after ends the stream. The response starts
        once the first choice is accepted: the others are accepted only when its prompt is
        in (they start from it), and a long prefill streams its progress meanwhile."""
        first = await handles[0].events.receive()
        if isinstance(first, Failed):
            return errors.from_code(first.code, first.message, max_context=self.max_context)
        encode = _encoder(False)
        if plan.stream:
            await responder.start(200, sse.HEADERS)
            await responder.body(encode(choices.start()))
        dones: list[Done | None] = [None] * len(handles)
        failed: Failed | None = None
        send, merged = trio.open_memory_channel[tuple[int, Any]](math.inf)
        async with trio.open_nursery() as nursery:
            for i, handle in enumerate(handles):
                nursery.start_soon(_forward, i, handle.events, send.clone())
            send.close()
            async for i, event in merged:
                if isinstance(event, Progress) and plan.stream:
                    await responder.body(sse.comment(f"prefill {event.done}/{event.total}"))
                elif isinstance(event, Token):
                    items = choices.token(i, event.text, event.logprobs)
                    if plan.stream and items:
                        await responder.body(encode(items))
                elif isinstance(event, Done):
                    self.metrics.finished(event)
                    dones[i] = event
                    if plan.stream:
                        await responder.body(encode(choices.finish(i, event)))
                    if all(d is not None for d in dones):
                        break
                elif isinstance(event, Failed):
                    failed = event
                    break
            nursery.cancel_scope.cancel()
        if failed is not None:
            error = errors.from_code(failed.code, failed.message, max_context=self.max_context)
            if plan.stream:
                await responder.body(sse.data(error.body(anthropic=False)), more=False)
            return None if plan.stream else error
        await self._answer_many(plan, choices, [d for d in dones if d is not None], responder)
        return None

    async def _answer_many(
        self, plan: openai.Plan, choices: Choices, dones: list[Done], responder: Responder
    ) -> None:
        """Every choice ended: the response, or the stream's last chunk."""
        if not plan.stream:
            await responder.json(200, choices.response(dones))
        else:
            await responder.body(_encoder(False)(choices.usage_chunk(dones)) + sse.DONE, more=False)


def _translator(plan: openai.Plan, kind: Callable[[openai.Plan], Any]) -> Any:
    """The plan's translator: one choice's, or `Choices` over n of them (the usage comes
    once, after every choice)."""
    if plan.n == 1:
        return kind(plan)
    one = replace(plan, include_usage=False)
    return Choices([kind(one) for _ in range(plan.n)], plan.include_usage)


async def _forward(i: int, events: Any, send: trio.MemorySendChannel[tuple[int, Any]]) -> None:
    """Choice i's events into the merged channel, up to its end."""
    async with send:
        async for event in events:
            await send.send((i, event))
            if isinstance(event, (Done, Failed)):
                return


def _encoder(anthropic_api: bool) -> Callable[[list[Any]], bytes]:
    if anthropic_api:
        return lambda items: b"".join(sse.named(name, payload) for name, payload in items)
    return lambda items: b"".join(sse.data(chunk) for chunk in items)


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


# ---- the listener ---------------------------------------------------------------------------
def bound_host(value: str | None) -> str | None:
    """The host part of the `http` setting (what `parse_bind` binds), for the Host rule."""
    if not value:
        return None
    host = value.rpartition(":")[0].strip("[]")
    return host or "127.0.0.1"


def parse_bind(value: str, api_key: str | None) -> str:
    """ "HOST:PORT" or "PORT" -> hypercorn bind; refuses a non-loopback host without a key."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"http = {value!r}: expected HOST:PORT or PORT")
    if not _loopback(host) and not api_key:
        raise ConfigError(
            f"http = {value!r} listens beyond this machine: set http_api_key "
            "in config.toml first (or bind 127.0.0.1)"
        )
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _loopback(host: str) -> bool:
    """A bind address on this machine only: a loopback name or literal (the Gate's rule),
    or a name every address of which is loopback (binding resolves it once, now)."""
    if is_loopback_host(host.lower()):
        return True
    try:
        return all(
            ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None)
        )
    except (OSError, ValueError):
        return False


async def serve_http(
    state: Any,
    settings: Any,
    binds: list[str],
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the API on `binds` (the sockets the daemon bound before loading the model:
    http/listen.py) until cancelled; `task_status` gets the bound URLs."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = binds
    config.accesslog = None
    config.errorlog = logging.getLogger("colibrid.http.server")
    config.graceful_timeout = 2.0
    # Slow clients: hypercorn's idle timer runs from accept until a request's headers are
    # complete (and between keep-alive requests), so this bounds a slowloris header phase as
    # well as an idle connection; the body has its own deadline (`read_body`). Headers
    # beyond h11's buffer (16 KiB) are refused with 431. No `read_timeout`: it would cut a
    # client that sends nothing while it waits minutes for a long generation.
    config.keep_alive_timeout = settings.http_body_timeout_s
    config.h11_max_incomplete_size = 16 * 1024
    await serve(HttpApp(state, settings), config, task_status=task_status)
