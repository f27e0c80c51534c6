"""One SERVE connection: frames in, requests to the scheduler, events out as lines.

Every request runs in its own task under the connection's nursery, so several can be in
flight and their DATA lines interleave; one lock keeps each frame's bytes together.
A malformed line costs one ERROR line, never the connection (unless the framing is lost:
TOO_LARGE). A bug met while handling one frame or one request's events costs that frame
or request an `ERROR <id> INTERNAL` line (and a traceback in the log), never the
connection's other requests. When the peer goes away (EOF, reset, a failed write) the
nursery is cancelled, which cancels that connection's requests and frees the engine.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace

import trio
from colibri_protocol.codec import (
    Frame,
    FrameDecoder,
    encode_line,
    is_valid_id,
    request_payload_length,
)
from colibri_protocol.errors import ProtocolError
from colibri_protocol.messages import (
    Cancel,
    Done,
    Hello,
    Load,
    Ping,
    ProfileCommand,
    Query,
    Quit,
    Request,
    Stop,
    Submit,
    Unload,
    encode_accept,
    encode_data,
    encode_done,
    encode_error,
    encode_logprobs,
    encode_progress,
    encode_reply,
    parse_request,
    stop_word,
)

from colibrid.errors import ColibriError, contain_panics
from colibrid.serve import events
from colibrid.serve.requests import GenerateRequest
from colibrid.serve.roofline import as_extras
from colibrid.serve.scheduler import Handle
from colibrid.serve.state import DaemonState, rss_gb

log = logging.getLogger("colibrid.session")
_client_ids = itertools.count(1)


@dataclass
class _Preparing:
    """A request not queued yet, and a STOP or CANCEL it got meanwhile."""

    stop: bool = False
    cancel: bool = False


class Connection:
    def __init__(self, stream: trio.abc.Stream, state: DaemonState) -> None:
        self.stream = stream
        self.state = state
        self.client = next(_client_ids)
        self.requests: dict[str, Handle] = {}
        self.loading: dict[str, _Preparing] = {}  # requests being prepared, not queued yet
        self._turn = trio.Event()  # set once the last SUBMIT so far is queued (or refused)
        self._turn.set()
        self._send_lock = trio.Lock()
        self._closed = False

    async def send(self, data: bytes) -> None:
        if self._closed:
            return
        async with self._send_lock:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._closed = True

    async def serve(self) -> None:
        decoder = FrameDecoder(request_payload_length)
        try:
            async with trio.open_nursery() as nursery:
                while not self._closed:
                    try:
                        data = await self.stream.receive_some(65536)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        break
                    if not data:
                        break
                    try:
                        items = decoder.feed(data)
                    except Exception:  # a codec bug: the framing is lost, say so and close
                        log.exception("client %d: frame decoder failed", self.client)
                        await self.send(encode_error("-", "INTERNAL", "frame decoder failed"))
                        break
                    for item in items:
                        await self._dispatch(item, nursery)
                    if decoder.broken:
                        break
                nursery.cancel_scope.cancel()
        finally:
            self.state.host.forget_client(self.client)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)

    async def _dispatch(self, item: object, nursery: trio.Nursery) -> None:
        before = dict(self.requests)  # what was in flight before this frame
        try:
            if isinstance(item, ProtocolError):
                raise item
            request = parse_request(item)  # type: ignore[arg-type]
            with contain_panics("a native library"):
                await self._handle(request, nursery)
        except ProtocolError as exc:
            await self.send(encode_error(exc.request_id, exc.code, exc.message))
            if exc.fatal:
                self._closed = True
        except ColibriError as exc:
            await self.send(encode_error(_frame_id(item, before), _code(exc), str(exc)))
        except Exception as exc:  # a bug: this frame is lost, the connection is not
            log.exception("client %d: handling %s failed", self.client, _frame_kind(item))
            await self.send(encode_error(_frame_id(item, before), "INTERNAL", _one_line(exc)))

    async def _handle(self, request: Request, nursery: trio.Nursery) -> None:
        state = self.state
        if isinstance(request, Submit):
            if request.id in self.requests or request.id in self.loading:
                raise ProtocolError(
                    "DUPLICATE_ID", f"request {request.id} is in flight", request.id
                )
            try:
                generate = GenerateRequest.from_submit(request, self.client)
            except ColibriError as exc:
                raise ProtocolError("BAD_REQUEST", str(exc), request.id) from None
            if not self._served(request.model):
                try:  # an unknown name is answered now, in this connection's order
                    state.models.resolve(request.model)
                except ColibriError as exc:
                    raise ProtocolError(_code(exc), str(exc), request.id) from None
            # prepared in its own task (a model to load, the prompt to tokenise, a grammar
            # to compile), queued in this connection's order: after the SUBMIT before it
            turn, self._turn = self._turn, trio.Event()
            self.loading[request.id] = _Preparing()
            nursery.start_soon(self._load_and_run, generate, request.model, turn, self._turn)
        elif isinstance(request, (Stop, Cancel)):
            self._stop_or_cancel(request.id, stop=isinstance(request, Stop))
        elif isinstance(request, Hello):
            await self.send(encode_line("HELLO", *state.hello()))
        elif isinstance(request, Query):
            body = {
                "STATUS": state.status,
                "MODEL": state.model_info,
                "TELEMETRY": state.telemetry,
            }[request.kind]()
            await self.send(encode_reply(request.kind, body))
        elif isinstance(request, ProfileCommand):
            kind, body = await state.profile(request.action, request.name, request.create)
            await self.send(encode_line("OK", *body) if kind == "OK" else encode_reply(kind, body))
        elif isinstance(request, Load):
            name = await state.ready(request.name)  # a remote model: nothing to load
            await self.send(encode_line("OK", "LOAD", name))
        elif isinstance(request, Unload):
            name = await state.models.unload("`colibri stop` (UNLOAD)")
            await self.send(encode_line("OK", "UNLOAD", name))
        elif isinstance(request, Ping):
            await self.send(b"PONG\n")
        elif isinstance(request, Quit):
            self._closed = True

    def _served(self, model: str | None) -> bool:
        """Whether a request for `model` runs on what is loaded, with nothing to load."""
        slot = self.state.models
        if slot.current is None or slot.loading is not None:
            return False
        return model is None or model == slot.current.name

    def _submit(self, generate: GenerateRequest) -> Handle:
        try:
            return self.state.submit_nowait(generate)
        except ColibriError as exc:
            raise ProtocolError(_code(exc), str(exc), generate.id) from None

    def _stop_or_cancel(self, rid: str, *, stop: bool) -> None:
        handle = self.requests.get(rid)
        if handle is not None:
            handle.stop() if stop else handle.cancel()
        elif rid in self.loading:  # still being prepared: applied once it is queued
            pending = self.loading[rid]
            pending.stop, pending.cancel = pending.stop or stop, pending.cancel or not stop
        else:
            raise ProtocolError("NOT_FOUND", f"no request {rid} in flight", rid)

    async def _load_and_run(
        self, generate: GenerateRequest, model: str | None, turn: trio.Event, mine: trio.Event
    ) -> None:
        """Load the model the request names (or the default), tokenise its prompt and
        compile its grammar (serve.prepare; a remote model's request is only checked),
        queue it once the SUBMIT before it was
        (`turn`; then `mine` lets the next one go), then run it; a model that cannot be
        loaded or a request that cannot be prepared ends it with the reason."""
        rid = generate.id
        try:
            with contain_panics("a native library"):
                await self.state.ready(model)
                generate = await self.state.prepare(generate, model)
            await turn.wait()
            handle = self._submit(generate)
            pending = self.loading.get(rid)
            if pending is not None and pending.stop:
                handle.stop()
            elif pending is not None and pending.cancel:
                handle.cancel()
        except ProtocolError as exc:
            await self.send(encode_error(rid, exc.code, exc.message))
            return
        except ColibriError as exc:
            await self.send(encode_error(rid, _code(exc), str(exc)))
            return
        except Exception as exc:  # a bug loading: this request is lost, not the daemon
            log.exception("client %d: loading for %s failed", self.client, rid)
            await self.send(encode_error(rid, "INTERNAL", _one_line(exc)))
            return
        finally:
            mine.set()
            self.loading.pop(rid, None)
        self.requests[rid] = handle
        await self._run(handle)

    async def _run(self, handle: Handle) -> None:
        rid = handle.job.request.id
        try:
            async with handle.track():
                async for event in handle.events:
                    await self.send(_encode(rid, event, self.state))
                    if isinstance(event, events.TERMINAL):
                        break
        except ColibriError as exc:
            await self.send(encode_error(rid, _code(exc), str(exc)))
        except Exception as exc:  # e.g. an event that cannot be encoded: this request ends
            log.exception("client %d: request %s failed while answering", self.client, rid)
            await self.send(encode_error(rid, "INTERNAL", _one_line(exc)))
        finally:
            self.requests.pop(rid, None)


def _frame_id(item: object, in_flight: dict[str, Handle]) -> str:
    """The id an ERROR about `item` names: a SUBMIT's, when it is valid and not (yet) in
    flight, since that ERROR ends the request; else `-`, so a failed STOP or CANCEL (or a
    SUBMIT that already runs) is never mistaken for the end of a running request."""
    if isinstance(item, Frame) and item.kind == "SUBMIT" and item.args:
        rid = item.args[0]
        if is_valid_id(rid) and rid not in in_flight:
            return rid
    return "-"


def _frame_kind(item: object) -> str:
    return item.kind if isinstance(item, Frame) else type(item).__name__


def _one_line(exc: BaseException) -> str:
    """`Type: message`, bounded: the ERROR line stays one short line whatever failed."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 200 else text[:197] + "..."


def _code(exc: ColibriError) -> str:
    from colibri_protocol.errors import CODES

    return exc.code if exc.code in CODES else "BAD_REQUEST"


def _encode(rid: str, event: events.Event, state: DaemonState) -> bytes:
    if isinstance(event, events.Token):
        data = encode_data(rid, event.text) if event.text else b""
        if event.logprobs is None:
            return data
        return encode_logprobs(replace(event.logprobs, id=rid)) + data
    if isinstance(event, events.Accepted):
        return encode_accept(rid, event.prompt_tokens)
    if isinstance(event, events.Progress):
        return encode_progress(rid, event.done, event.total)
    if isinstance(event, events.Failed):
        return encode_error(rid, event.code, event.message)
    hit_rate = state.tiers().get("hit_rate") or 0.0
    done = Done(
        rid,
        event.generated_tokens,
        event.decode_tok_s,
        100.0 * hit_rate,
        rss_gb(),
        event.prompt_tokens,
        event.finish == "length",
        {
            "finish": event.finish,
            "cached": str(event.cached_tokens),
            "prefill_s": f"{event.prefill_s:.4f}",
            "decode_s": f"{event.decode_s:.4f}",
            "prefill_tok_s": f"{event.prefill_tok_s:.1f}",
            **(event.speculation or {}),
            **(event.constraint or {}),
            **({} if event.plan is None else {"plan": event.plan}),
            **({} if event.stop_string is None else {"stop": stop_word(event.stop_string)}),
            **as_extras(event.roofline),
        },
    )
    return encode_done(done)


async def serve_connection(stream: trio.abc.Stream, state: DaemonState) -> None:
    """The per-connection handler given to `trio.serve_listeners`."""
    try:
        await Connection(stream, state).serve()
    except Exception:
        log.exception("connection handler failed")  # costs this connection only
