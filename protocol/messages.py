"""Typed SERVE messages on top of the framing: requests the daemon parses, responses the
clients parse, and the encoders for both. Still sans-IO and free of heavy imports.

Requests validate *syntax* only (numbers are numbers, ids are ids, JSON is JSON); the
daemon validates meaning (sampling ranges, context) and answers BAD_REQUEST with the reason.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

from colibri_protocol.bounded_json import JsonTooDeep, loads_bounded
from colibri_protocol.codec import (
    Frame,
    encode_framed,
    encode_line,
    encode_text_line,
    is_valid_id,
    positional,
)
from colibri_protocol.errors import ProtocolError
from colibri_protocol.grammar import FORMATS, encode_grammar, format_grammar, parse_grammar

# ---- requests (client -> daemon) ----------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    version: int


@dataclass(frozen=True)
class Submit:
    """One generation request. Exactly one of `prompt` (raw text, the template is the
    client's business) and `messages` (a chat list the daemon renders) is set."""

    id: str
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repeat_penalty: float = 1.0  # 1 = off
    repeat_last_n: int = 64  # the window repeat_penalty looks at (0 off, -1 the context)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logprobs: int | None = None  # a LOGPROBS line per token, with this many alternatives
    conv: str | None = None
    profile: str | None = None
    model: str | None = None
    speculate: str | None = None  # off | ngram | mtp | auto (None: the daemon's setting)
    draft_max: int | None = None  # the deepest speculative draft (None: the daemon's)
    keep_alive: float | None = None  # seconds the model stays loaded when idle after this
    # the answer's shape: {"json_schema": {...}} | {"lark": "..."} | {"regex": "..."}
    grammar: dict[str, Any] | None = None


@dataclass(frozen=True)
class Stop:
    id: str


@dataclass(frozen=True)
class Cancel:
    id: str


@dataclass(frozen=True)
class Query:
    """STATUS, MODEL or TELEMETRY: answered with a JSON reply of the same kind."""

    kind: str


@dataclass(frozen=True)
class ProfileCommand:
    """PROFILE LIST | SHOW <name> | USE <name> | SAVE [<name>] | FLUSH."""

    action: str
    name: str | None = None
    create: bool = False  # USE: start an empty profile when there is none of that name


@dataclass(frozen=True)
class Load:
    """LOAD <name>: serve the installed model NAME (loaded now when the daemon is idle)."""

    name: str


@dataclass(frozen=True)
class Unload:
    """UNLOAD: let the loaded model go (the daemon stays; the next request loads one)."""


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Quit:
    pass


Request = Hello | Submit | Stop | Cancel | Query | ProfileCommand | Load | Unload | Ping | Quit

_INT_OPTS = {"max_tokens", "top_k", "seed", "draft_max", "gbytes", "repeat_last_n", "logprobs"}
_SECONDS_OPTS = {"keep_alive"}  # seconds, or a duration: 30s, 5m, 1h (negative: forever)
_FLOAT_OPTS = {
    "temperature",
    "top_p",
    "repeat_penalty",
    "frequency_penalty",
    "presence_penalty",
    "min_p",
}
_STR_OPTS = {"conv", "profile", "model", "speculate"}
_PROFILE_ACTIONS = {"LIST": 0, "SHOW": 1, "USE": 1, "SAVE": -1, "FLUSH": 0}


def _options(args: Sequence[str], rid: str) -> dict[str, Any]:
    opts: dict[str, Any] = {"stop": []}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ProtocolError("BAD_FRAME", f"expected key=value, got {arg!r}", rid)
        if key in opts and key != "stop":  # only stop= repeats; else which one would win?
            raise ProtocolError(
                "BAD_REQUEST", f"option {key} given twice (only stop= may repeat)", rid
            )
        try:
            if key in _INT_OPTS:
                opts[key] = int(value)
            elif key in _FLOAT_OPTS:
                opts[key] = float(value)
                if not math.isfinite(opts[key]):
                    raise ValueError(value)
            elif key in _SECONDS_OPTS:
                opts[key] = seconds(value)
            elif key == "stop":
                opts["stop"].append(_stop_string(value, rid))
            elif key == "chat":
                if value not in ("0", "1"):
                    raise ValueError(value)
                opts["chat"] = value == "1"
            elif key == "format":
                if value not in FORMATS:
                    raise ValueError(value)
                opts["format"] = value
            elif key in _STR_OPTS:
                if not is_valid_id(value):
                    raise ValueError(value)
                opts[key] = value
            else:
                raise ProtocolError("BAD_REQUEST", f"unknown option {key!r}", rid)
        except (ValueError, UnicodeDecodeError):
            raise ProtocolError(
                "BAD_REQUEST", f"bad value for {key}: {value[:40]!r}", rid
            ) from None
    return opts


# `%` not followed by two hex digits: `unquote` would keep it literally, so `%ZZ%` and a
# cut-off `%4` would silently become stop strings nobody meant.
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


def seconds(value: str) -> float:
    """A duration: plain seconds, or with a unit s, m or h ("90", "30s", "5m", "1h")."""
    text = value.strip().lower()
    scale = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(text[-1:], 0.0)
    number = float(text[:-1]) if scale else float(text)
    result = number * (scale or 1.0)
    if not math.isfinite(result):
        raise ValueError(value)
    return result


def stop_word(text: str) -> str:
    """A stop string as one ``stop=`` word: percent-encoded UTF-8, as SUBMIT's option and
    DONE's extra carry it (no whitespace, ``%`` as ``%25``)."""
    return quote(text, safe="")


def _stop_string(value: str, rid: str) -> str:
    """A `stop=` value: percent-decoded strictly (every `%` starts a `%XX` escape, the bytes
    are UTF-8) and non-empty, since an empty stop string would end every answer at once."""
    bad = _BAD_ESCAPE.search(value)
    if bad:
        raise ProtocolError(
            "BAD_REQUEST",
            f"bad percent escape in stop at {value[bad.start() : bad.start() + 3]!r} "
            "(write a % as %25)",
            rid,
        )
    text = unquote(value, errors="strict")  # UnicodeDecodeError: the caller's BAD_REQUEST
    if not text:
        raise ProtocolError("BAD_REQUEST", "stop strings must not be empty", rid)
    return text


def _messages(text: str, rid: str) -> tuple[dict[str, Any], ...]:
    try:
        value = loads_bounded(text)
    except JsonTooDeep as exc:  # 100,000 brackets: a bad request, not a RecursionError
        raise ProtocolError("BAD_REQUEST", f"chat payload refused: {exc}", rid) from None
    except ValueError as exc:
        raise ProtocolError("BAD_REQUEST", f"chat payload is not JSON: {exc}", rid) from None
    if isinstance(value, dict):
        value = value.get("messages")
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    )
    if not ok:
        raise ProtocolError(
            "BAD_REQUEST",
            'chat payload must be a non-empty JSON list of {"role": ..., "content": ...} objects',
            rid,
        )
    return tuple(value)


def _parse_submit(frame: Frame) -> Submit:
    args, payload = frame.args, frame.payload or b""
    rid = args[0] if args else "-"
    if not is_valid_id(rid):
        raise ProtocolError("BAD_FRAME", f"bad request id {rid[:40]!r} (1-63 of A-Za-z0-9_.:-)")
    pos = positional(args)
    opts = _options(args[len(pos) :], rid)
    gbytes = opts.pop("gbytes", 0)
    if len(pos) >= 6:  # upstream mux form: slot, bytes, max_tokens, temperature, top_p
        try:
            opts.setdefault("max_tokens", int(pos[3]))
            opts.setdefault("temperature", float(pos[4]))
            opts.setdefault("top_p", float(pos[5]))
        except ValueError:
            raise ProtocolError("BAD_REQUEST", "bad number in SUBMIT", rid) from None
        if pos[1] not in ("0", "-"):
            opts.setdefault("conv", f"slot{pos[1]}")
        if gbytes:
            raise ProtocolError("BAD_REQUEST", "gbytes= is the native form's; use <gbytes>", rid)
        # the grammar's bytes follow the prompt's (the codec read both)
        gbytes = int(pos[6]) if len(pos) >= 7 else 0
        payload = payload[: int(pos[2]) + gbytes]
    if not 0 <= gbytes <= len(payload):
        raise ProtocolError(
            "BAD_REQUEST", f"gbytes={gbytes} but the payload has {len(payload)} bytes", rid
        )
    payload, grammar_bytes = payload[: len(payload) - gbytes], payload[len(payload) - gbytes :]
    grammar = parse_grammar(grammar_bytes, rid) if gbytes else None
    form = opts.pop("format", None)
    if form is not None:
        if grammar is not None:
            raise ProtocolError("BAD_REQUEST", "give format= or a grammar payload, not both", rid)
        grammar = format_grammar(form)
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("BAD_REQUEST", "payload is not valid UTF-8", rid) from None
    chat = opts.pop("chat", False)
    stop = tuple(opts.pop("stop"))
    if chat:
        return Submit(rid, messages=_messages(text, rid), stop=stop, grammar=grammar, **opts)
    return Submit(rid, prompt=text, stop=stop, grammar=grammar, **opts)


def parse_request(frame: Frame) -> Request:
    """A client frame as a typed request, or ProtocolError naming the problem."""
    kind, args = frame.kind, frame.args
    if kind == "SUBMIT":
        return _parse_submit(frame)
    if kind in ("STOP", "CANCEL"):
        if len(args) != 1 or not is_valid_id(args[0]):
            raise ProtocolError("BAD_FRAME", f"{kind} needs `{kind} <id>`")
        return Stop(args[0]) if kind == "STOP" else Cancel(args[0])
    if kind == "HELLO":
        if len(args) > 1 or (args and not args[0].isdigit()):
            raise ProtocolError("BAD_FRAME", "HELLO needs `HELLO [<version>]`")
        return Hello(int(args[0]) if args else 1)
    if kind in ("STATUS", "MODEL", "TELEMETRY"):
        if args:
            raise ProtocolError("BAD_FRAME", f"{kind} takes no arguments")
        return Query(kind)
    if kind == "PROFILE":
        return _parse_profile(args)
    if kind == "LOAD":
        if len(args) != 1 or not is_valid_id(args[0]):
            raise ProtocolError("BAD_FRAME", "LOAD needs `LOAD <model name>`")
        return Load(args[0])
    if kind == "UNLOAD":
        if args:
            raise ProtocolError("BAD_FRAME", "UNLOAD takes no arguments")
        return Unload()
    if kind in ("PING", "QUIT"):
        return Ping() if kind == "PING" else Quit()
    raise ProtocolError(
        "UNKNOWN_VERB",
        f"unknown verb {kind[:40]!r} (try HELLO, SUBMIT, "
        "STOP, CANCEL, STATUS, MODEL, TELEMETRY, PROFILE, LOAD, UNLOAD, PING, QUIT)",
    )


def _parse_profile(args: Sequence[str]) -> ProfileCommand:
    action = args[0].upper() if args else ""
    arity = _PROFILE_ACTIONS.get(action)
    names = list(args[1:])
    create = action == "USE" and len(names) == 2 and names[1].upper() == "CREATE"
    if create:
        names = names[:1]
    if arity is None or (arity >= 0 and len(names) != arity) or len(names) > 1:
        raise ProtocolError(
            "BAD_FRAME",
            "PROFILE needs LIST | SHOW <name> | USE <name> [CREATE] | SAVE [<name>] | FLUSH",
        )
    if names and not is_valid_id(names[0]):
        raise ProtocolError("BAD_REQUEST", f"bad profile name {names[0][:40]!r}")
    return ProfileCommand(action, names[0] if names else None, create)


def encode_submit(req: Submit) -> bytes:
    """The native SUBMIT frame for `req` (what `colibri ask` sends)."""
    opts = [f"max_tokens={req.max_tokens}", f"temperature={req.temperature:g}"]
    if req.top_p != 1.0:
        opts.append(f"top_p={req.top_p:g}")
    if req.top_k:
        opts.append(f"top_k={req.top_k}")
    if req.seed is not None:
        opts.append(f"seed={req.seed}")
    defaults = Submit("-")
    opts += [  # repr: a float's shortest exact form
        f"{k}={v!r}"
        for k in (
            "repeat_penalty",
            "repeat_last_n",
            "frequency_penalty",
            "presence_penalty",
            "min_p",
            "logprobs",
        )
        if (v := getattr(req, k)) != getattr(defaults, k)
    ]
    opts += [f"stop={stop_word(s)}" for s in req.stop]
    opts += [
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
        for k in ("conv", "profile", "model", "speculate", "draft_max", "keep_alive")
        if (v := getattr(req, k)) is not None
    ]
    if req.messages is not None:
        opts.append("chat=1")
        payload = json.dumps(list(req.messages), ensure_ascii=False).encode("utf-8")
    else:
        payload = (req.prompt or "").encode("utf-8")
    if req.grammar is not None:  # after the prompt, inside the payload's byte count
        grammar = encode_grammar(req.grammar)
        opts.append(f"gbytes={len(grammar)}")
        payload += grammar
    return encode_framed("SUBMIT", req.id, payload=payload, options=opts)


# ---- responses (daemon -> client) ---------------------------------------------------------


@dataclass(frozen=True)
class Accept:
    id: str
    prompt_tokens: int


@dataclass(frozen=True)
class Progress:
    """``PROGRESS <id> prefill <done> <total>``: a long prefill has computed `done` of
    `total` layers."""

    id: str
    done: int
    total: int

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total > 0 else 0.0


@dataclass(frozen=True)
class Data:
    id: str
    text: str


@dataclass(frozen=True)
class Alternative:
    """A token as LOGPROBS reports it: its id, its bytes (a token may hold part of a UTF-8
    character) and its log-probability."""

    token: int
    bytes: bytes
    logprob: float

    def as_json(self) -> dict[str, Any]:
        return {"token": self.token, "bytes": list(self.bytes), "logprob": self.logprob}

    @classmethod
    def of_json(cls, item: Any) -> Alternative:
        return cls(int(item["token"]), bytes(item["bytes"]), float(item["logprob"]))


@dataclass(frozen=True)
class Logprobs:
    """``LOGPROBS <id> <bytes>`` LF JSON LF: one generated token (`chosen`) and its best
    alternatives (`top`, best first), sent before the token's DATA when the request
    asked with ``logprobs=K``."""

    id: str
    chosen: Alternative
    top: tuple[Alternative, ...] = ()


@dataclass(frozen=True)
class Done:
    """``DONE <id> STAT <emitted> <tok_s> <hit_pct> <rss_gb> <prompt_tokens> <length_limited>``
    (upstream's fields, in upstream's order) then ``key=value`` extras."""

    id: str
    emitted: int
    tok_s: float
    hit_pct: float
    rss_gb: float
    prompt_tokens: int
    length_limited: bool
    extras: dict[str, str] = field(default_factory=dict)

    @property
    def finish(self) -> str:
        return self.extras.get("finish", "length" if self.length_limited else "stop")

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the answer (the ``stop=`` extra), or None."""
        word = self.extras.get("stop")
        return None if word is None else unquote(word, errors="replace")


@dataclass(frozen=True)
class ErrorReply:
    id: str
    code: str
    message: str


@dataclass(frozen=True)
class Reply:
    """A JSON reply (STATUS, MODEL, TELEMETRY, PROFILES, PROFILE)."""

    kind: str
    body: Any


@dataclass(frozen=True)
class Line:
    """Any other line (HELLO, OK, PONG, or a kind this client does not know: ignore it)."""

    kind: str
    args: tuple[str, ...]


Response = Accept | Progress | Data | Logprobs | Done | ErrorReply | Reply | Line


def encode_accept(rid: str, prompt_tokens: int) -> bytes:
    return encode_line("ACCEPT", rid, prompt_tokens)


def encode_progress(rid: str, done: int, total: int) -> bytes:
    return encode_line("PROGRESS", rid, "prefill", done, total)


def encode_data(rid: str, text: str) -> bytes:
    return encode_framed("DATA", rid, payload=text.encode("utf-8"))


def encode_logprobs(item: Logprobs) -> bytes:
    body = {**item.chosen.as_json(), "top": [t.as_json() for t in item.top]}
    return encode_framed("LOGPROBS", item.id, payload=json.dumps(body).encode("utf-8"))


def encode_done(done: Done) -> bytes:
    extras = [f"{k}={v}" for k, v in done.extras.items()]
    return encode_line(
        "DONE",
        done.id,
        "STAT",
        done.emitted,
        f"{done.tok_s:.2f}",
        f"{done.hit_pct:.1f}",
        f"{done.rss_gb:.2f}",
        done.prompt_tokens,
        int(done.length_limited),
        *extras,
    )


def encode_error(rid: str, code: str, message: str) -> bytes:
    return encode_text_line("ERROR", rid, code, text=message)


def encode_reply(kind: str, body: Any) -> bytes:
    return encode_framed(kind, payload=json.dumps(body, sort_keys=True).encode("utf-8"))


def parse_response(frame: Frame) -> Response:
    """A daemon frame as a typed response; unknown kinds come back as `Line` (ignore them)."""
    kind, args = frame.kind, frame.args
    try:
        if kind == "ACCEPT":
            return Accept(args[0], int(args[1]))
        if kind == "PROGRESS" and len(args) >= 4 and args[1] == "prefill":
            return Progress(args[0], int(args[2]), int(args[3]))
        if kind == "DATA":
            return Data(args[0], (frame.payload or b"").decode("utf-8", errors="replace"))
        if kind == "LOGPROBS":
            body = loads_bounded(frame.payload or b"null")
            top = tuple(Alternative.of_json(t) for t in body["top"])
            return Logprobs(args[0], Alternative.of_json(body), top)
        if kind == "DONE":
            return _parse_done(args)
        if kind == "ERROR":
            return ErrorReply(args[0], args[1] if len(args) > 1 else "INTERNAL", " ".join(args[2:]))
        if kind in ("STATUS", "MODEL", "TELEMETRY", "PROFILES", "PROFILE"):
            return Reply(kind, loads_bounded(frame.payload or b"null"))
    except (IndexError, ValueError, KeyError, TypeError) as exc:
        raise ProtocolError("BAD_FRAME", f"malformed {kind} from the daemon: {exc}") from None
    return Line(kind, args)


def _parse_done(args: Sequence[str]) -> Done:
    if len(args) < 8 or args[1] != "STAT":
        raise ValueError("DONE needs `DONE <id> STAT` and six fields")
    extras = dict(a.partition("=")[::2] for a in args[8:] if "=" in a)
    return Done(
        args[0],
        int(args[2]),
        float(args[3]),
        float(args[4]),
        float(args[5]),
        int(args[6]),
        args[7] == "1",
        extras,
    )
