"""Talking to a remote OpenAI-compatible endpoint: one streamed POST per request, and the
errors it can end in, each as one line.

`Upstream` is the seam the daemon's remote runner (serve.remote_runs) streams through;
`HttpUpstream` is its implementation over httpx (the HTTP client the rest of the Python
world's OpenAI clients use), which runs in trio through anyio. Leaving `open`'s block
early (a client gone, a CANCEL) closes the connection, which is how llama-server, vLLM,
SGLang and colibrid notice that nobody wants the rest and stop generating it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

import httpx

from colibrid.errors import ColibriError, RequestError
from colibrid.remote.spec import RemoteSpec

CONNECT_S = 10.0  # an endpoint that takes longer to accept is down
# Longest silence between two bytes of an answer: a big model's prefill of a long prompt
# on a cluster can take minutes before the first one.
READ_S = 600.0
MAX_MESSAGE = 300  # characters of an endpoint's error a client reads


class RemoteError(ColibriError):
    """The endpoint failed: unreachable, an error status, a timeout, a broken stream."""

    code = "REMOTE"


class Upstream(Protocol):
    """Where a remote model's requests are sent (HttpUpstream): the runner depends on this
    seam, not on httpx, so the transport can change without touching it."""

    def open(
        self, spec: RemoteSpec, key: str | None, route: str, body: dict[str, Any]
    ) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]:
        """POST `body` to `route` streamed; the block reads its chunk objects, and leaving
        it closes the connection. Errors are ColibriErrors (status_error, transport_error)."""
        ...


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def error_text(raw: bytes) -> str:
    """The message of an endpoint's error body: OpenAI's ``{"error": {"message"}}``,
    ``{"error": "..."}``, vLLM's ``{"message"}`` or FastAPI's ``{"detail"}``, else the
    body's text, on one bounded line."""
    text = raw.decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        return _one_line(text) or "(no body)"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return _one_line(str(error["message"]))
        for found in (error, data.get("message"), data.get("detail")):
            if found:
                return _one_line(found if isinstance(found, str) else json.dumps(found))
    return _one_line(text)


def status_error(spec: RemoteSpec, status: int, raw: bytes) -> ColibriError:
    """An endpoint's refusal as the error the client reads: what it said of the request
    (400, 422) is a bad request, a full endpoint (429, 503) is busy, the rest is REMOTE."""
    said = error_text(raw)
    who = f"the remote model {spec.name} ({spec.url})"
    if status in (400, 422):
        return RequestError(f"{who} refused the request: {said}")
    if status in (401, 403):
        return RemoteError(
            f"{who} refused the API key ({status}: {said}); set the key in config "
            f"([remote.{spec.name}] in config.toml, or `colibri pull {spec.url} --name "
            f"{spec.name} --force --api-key-env VAR`)"
        )
    if status in (429, 503):
        return ColibriError(f"{who} is busy ({status}: {said}); try again later", code="BUSY")
    return RemoteError(f"{who} answered {status}: {said}")


def transport_error(spec: RemoteSpec, exc: httpx.HTTPError) -> RemoteError:
    """A connection that failed or stalled, in words."""
    if isinstance(exc, httpx.ConnectTimeout):
        return RemoteError(f"cannot reach {spec.url}: no answer within {CONNECT_S:g} s")
    if isinstance(exc, httpx.TimeoutException):
        return RemoteError(f"{spec.url} sent nothing for {READ_S:g} s; the request was dropped")
    if isinstance(exc, httpx.ConnectError):
        return RemoteError(f"cannot reach {spec.url}: {_one_line(str(exc)) or 'refused'}")
    what = _one_line(str(exc)) or type(exc).__name__
    return RemoteError(f"the connection to {spec.url} broke: {what}")


async def events(response: httpx.Response, spec: RemoteSpec) -> AsyncIterator[dict[str, Any]]:
    """The objects of a server-sent event stream, up to ``[DONE]`` (or its end); an
    ``{"error": …}`` event is raised as the endpoint's error."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data.append(line[5:].strip())
            continue
        if line or not data:  # `event:`, `id:`, a `:` comment; or a blank line alone
            continue
        payload, data = "\n".join(data), []
        if payload == "[DONE]":
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            raise RemoteError(f"{spec.url} sent an event that is not JSON") from None
        if isinstance(chunk, dict) and chunk.get("error"):
            raise RemoteError(f"{spec.url} failed mid-answer: {error_text(payload.encode())}")
        if isinstance(chunk, dict):
            yield chunk


class HttpUpstream:
    """`Upstream` over HTTP: a fresh connection per request (a cancelled one is closed,
    never handed to the next)."""

    @asynccontextmanager
    async def open(
        self, spec: RemoteSpec, key: str | None, route: str, body: dict[str, Any]
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        headers = {"accept": "text/event-stream"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        timeout = httpx.Timeout(READ_S, connect=CONNECT_S)
        try:
            async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
                url = spec.endpoint(route)
                async with client.stream("POST", url, json=body, headers=headers) as response:
                    if response.status_code != 200:
                        raise status_error(spec, response.status_code, await _head(response))
                    yield events(response, spec)
        except httpx.HTTPError as exc:
            raise transport_error(spec, exc) from None


async def _head(response: httpx.Response, limit: int = 64 * 1024) -> bytes:
    """The first bytes of an error body (an endpoint's error page can be large)."""
    out = b""
    async for part in response.aiter_bytes():
        out += part
        if len(out) >= limit:
            break
    return out[:limit]
