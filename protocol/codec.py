"""Sans-IO framing of the SERVE protocol: bytes in, `Frame`s out, and back.

The codec does no I/O, so the daemon (trio streams) and the clients (a blocking socket)
share it, and tests can throw arbitrary bytes at it. A frame is one LF-terminated UTF-8
line ``KIND arg arg ...``; a few kinds announce a byte count and are followed by exactly
that many payload bytes and one LF (payloads may contain newlines). Which kinds carry a
payload depends on the direction, so a decoder is built with the matching table
(`request_payload_length` for what clients send, `response_payload_length` for what the
daemon sends). Errors never break the stream when the framing allows recovery: the
decoder reports a `ProtocolError` and resynchronises at the next LF.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from colibri_protocol.errors import ProtocolError

PROTOCOL_VERSION = 1
MAX_LINE_BYTES = 64 * 1024
MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
MAX_ID_CHARS = 63
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-")

#: Reply kinds the daemon sends as ``KIND <bytes>`` + a JSON payload.
JSON_REPLY_KINDS = frozenset({"STATUS", "MODEL", "TELEMETRY", "PROFILES", "PROFILE"})


@dataclass(frozen=True)
class Frame:
    """One protocol unit: its kind (upper case), its whitespace-separated args, a payload."""

    kind: str
    args: tuple[str, ...] = ()
    payload: bytes | None = None


PayloadRule = Callable[[str, Sequence[str]], int | None]


def is_valid_id(text: str) -> bool:
    return 0 < len(text) <= MAX_ID_CHARS and set(text) <= _ID_CHARS


def parse_count(text: str, what: str, request_id: str = "-") -> int:
    """A decimal byte count (digits only, bounded) or BAD_FRAME / TOO_LARGE."""
    if not text.isdigit() or not text.isascii() or len(text) > 10:
        raise ProtocolError(
            "BAD_FRAME", f"{what} must be a decimal byte count, got {text!r}", request_id
        )
    n = int(text)
    if n > MAX_PAYLOAD_BYTES:
        raise ProtocolError(
            "TOO_LARGE", f"{what} {n} exceeds the limit of {MAX_PAYLOAD_BYTES}", request_id
        )
    return n


def positional(args: Sequence[str]) -> list[str]:
    """The leading args that are not ``key=value`` options."""
    out: list[str] = []
    for arg in args:
        if "=" in arg:
            break
        out.append(arg)
    return out


def request_payload_length(kind: str, args: Sequence[str]) -> int | None:
    """Payload size of a client frame: only SUBMIT carries one.

    Native form ``SUBMIT <id> <bytes> [key=value...]``; upstream's mux form
    ``SUBMIT <id> <slot> <bytes> <max_tokens> <temperature> <top_p> [<gbytes> [<prefix>]]``
    (its grammar bytes follow the prompt, so they are part of the payload here).
    """
    if kind != "SUBMIT":
        return None
    pos = positional(args)
    rid = args[0] if args and is_valid_id(args[0]) else "-"
    if len(pos) == 2:
        return parse_count(pos[1], "SUBMIT byte count", rid)
    if 6 <= len(pos) <= 8:
        total = parse_count(pos[2], "SUBMIT byte count", rid)
        if len(pos) >= 7:
            total += parse_count(pos[6], "SUBMIT grammar byte count", rid)
        if total > MAX_PAYLOAD_BYTES:
            raise ProtocolError("TOO_LARGE", f"payload {total} exceeds the limit", rid)
        return total
    raise ProtocolError("BAD_FRAME", "SUBMIT needs `SUBMIT <id> <bytes> [key=value...]`", rid)


def response_payload_length(kind: str, args: Sequence[str]) -> int | None:
    """Payload size of a daemon frame: DATA and the JSON replies carry one."""
    if kind in ("DATA", "LOGPROBS"):
        if len(args) < 2:
            raise ProtocolError("BAD_FRAME", f"{kind} needs `{kind} <id> <bytes>`")
        return parse_count(args[1], f"{kind} byte count")
    if kind in JSON_REPLY_KINDS:
        if len(args) != 1:
            raise ProtocolError("BAD_FRAME", f"{kind} needs `{kind} <bytes>`")
        return parse_count(args[0], f"{kind} byte count")
    return None


class FrameDecoder:
    """Splits a byte stream into frames; `feed` returns frames and errors in order.

    A header line longer than `max_line` is reported once (LINE_TOO_LONG) and skipped up
    to its LF. Blank lines are ignored (a person pressing Enter in socat). CRLF is
    accepted as LF. A payload must be followed by LF, else BAD_FRAME and a resync at the
    next LF. After a fatal error (TOO_LARGE) the decoder refuses further input.
    """

    def __init__(self, payload_rule: PayloadRule, *, max_line: int = MAX_LINE_BYTES) -> None:
        self._rule = payload_rule
        self._max_line = max_line
        self._buf = bytearray()
        self._skipping = False  # discarding up to the next LF
        self._pending: tuple[str, tuple[str, ...], int] | None = None  # header awaiting payload
        self.broken = False

    def feed(self, data: bytes) -> list[Frame | ProtocolError]:
        if self.broken:
            return []
        self._buf += data
        out: list[Frame | ProtocolError] = []
        while True:
            item = self._payload() if self._pending else self._line()
            if item is None:
                return out
            out.append(item)
            if isinstance(item, ProtocolError) and item.fatal:
                self.broken = True
                self._buf.clear()
                return out

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def _line(self) -> Frame | ProtocolError | None:
        while True:
            end = self._buf.find(b"\n")
            if self._skipping:
                if end < 0:
                    self._buf.clear()
                    return None
                del self._buf[: end + 1]
                self._skipping = False
                continue
            if end < 0:
                if len(self._buf) > self._max_line:
                    self._buf.clear()
                    self._skipping = True
                    return ProtocolError(
                        "LINE_TOO_LONG", f"line longer than {self._max_line} bytes"
                    )
                return None
            raw = bytes(self._buf[:end])
            del self._buf[: end + 1]
            if len(raw) > self._max_line:
                return ProtocolError("LINE_TOO_LONG", f"line longer than {self._max_line} bytes")
            item = self._header(raw.removesuffix(b"\r"))
            if item is not None or self._pending:
                return item

    def _header(self, raw: bytes) -> Frame | ProtocolError | None:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return ProtocolError("BAD_FRAME", "line is not valid UTF-8")
        parts = text.split()
        if not parts:
            return None
        kind, args = parts[0].upper(), tuple(parts[1:])
        if not kind.isascii() or not kind.isalpha():
            return ProtocolError("BAD_FRAME", f"a line starts with a verb, got {parts[0][:40]!r}")
        try:
            n = self._rule(kind, args)
        except ProtocolError as exc:
            return exc
        if n is None:
            return Frame(kind, args)
        self._pending = (kind, args, n)
        return self._payload()

    def _payload(self) -> Frame | ProtocolError | None:
        assert self._pending is not None
        kind, args, n = self._pending
        if len(self._buf) < n + 1:
            return None
        payload = bytes(self._buf[:n])
        tail = self._buf[n : n + 2]
        self._pending = None
        if tail[:1] == b"\n":
            del self._buf[: n + 1]
        elif tail == b"\r\n":
            del self._buf[: n + 2]
        elif tail[:1] == b"\r" and len(tail) < 2:
            self._pending = (kind, args, n)  # wait for the LF after CR
            return None
        else:
            del self._buf[:n]
            self._skipping = True
            rid = args[0] if args and is_valid_id(args[0]) else "-"
            return ProtocolError(
                "BAD_FRAME",
                f"payload of {n} bytes is not followed by LF (is the byte count right?)",
                rid,
            )
        return Frame(kind, args, payload)


def encode_line(kind: str, *args: object) -> bytes:
    """``KIND arg ...`` + LF; args must not contain whitespace (checked)."""
    words = [kind, *(str(a) for a in args)]
    for word in words:
        if not word or any(c.isspace() for c in word):
            raise ValueError(f"protocol word {word!r} is empty or contains whitespace")
    return (" ".join(words) + "\n").encode("utf-8")


def encode_text_line(kind: str, *args: object, text: str) -> bytes:
    """Like `encode_line` with free text at the end (an ERROR message): LFs become spaces.
    Text that is not valid Unicode (a lone surrogate from some exception's message) is
    escaped rather than raised: an ERROR line must always be sendable."""
    head = encode_line(kind, *args)[:-1]
    clean = " ".join(text.split())
    body = clean.encode("utf-8", errors="backslashreplace")
    return head + (b" " + body if clean else b"") + b"\n"


def encode_framed(kind: str, *args: object, payload: bytes, options: Sequence[str] = ()) -> bytes:
    """``KIND args... <len(payload)> options...`` + LF + payload + LF."""
    return encode_line(kind, *args, len(payload), *options) + payload + b"\n"
