"""SUBMIT content limits, sans-IO: a chat payload nested past the JSON depth limit, a stop
string with a broken percent escape or none at all, are BAD_REQUEST with a reason, while
every value the spec allows (and `encode_submit` produces) still parses to what was meant.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from colibri_protocol.bounded_json import MAX_DEPTH
from colibri_protocol.codec import Frame, encode_text_line
from colibri_protocol.errors import ProtocolError
from colibri_protocol.messages import Submit, encode_submit, parse_request, parse_response
from hypothesis import given, settings
from hypothesis import strategies as st

SPEC = (Path(__file__).resolve().parents[2] / "protocol" / "SERVE.md").read_text()


def submit(payload: bytes, *options: str, rid: str = "r1") -> Frame:
    return Frame("SUBMIT", (rid, str(len(payload)), *options), payload)


def refused(frame: Frame) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_request(frame)
    return info.value


def nested(depth: int) -> bytes:
    """A chat list whose one message carries `depth` containers in all (list + dict + ...)."""
    inner = "[" * (depth - 2) + "]" * (depth - 2)
    return f'[{{"role": "user", "content": "hi", "x": {inner}}}]'.encode()


def test_100k_brackets_are_a_bad_request_naming_the_limit() -> None:
    for payload in (b"[" * 100_000 + b"]" * 100_000, b"[" * 100_000, b'{"a":' * 100_000):
        exc = refused(submit(payload, "chat=1"))
        assert exc.code == "BAD_REQUEST" and exc.request_id == "r1"
        assert f"deeper than {MAX_DEPTH}" in exc.message


def test_depth_limit_is_exact_and_documented() -> None:
    ok = parse_request(submit(nested(MAX_DEPTH), "chat=1"))
    assert ok.messages[0]["content"] == "hi"
    assert refused(submit(nested(MAX_DEPTH + 1), "chat=1")).code == "BAD_REQUEST"
    assert f"deeper than {MAX_DEPTH} containers" in SPEC


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        b"[]",
        b"{}",
        b'[{"role": "user"}]',
        b'[{"role": "user", "content": 5}]',
        b'[{"role": 1, "content": "x"}]',
        b'["user", "x"]',
        b"[" + b"1" * 5000 + b"]",  # an int past Python's digit limit: ValueError, not a crash
    ],
)
def test_malformed_chat_payloads_are_bad_requests(payload: bytes) -> None:
    assert refused(submit(payload, "chat=1")).code == "BAD_REQUEST"


def test_roles_are_not_restricted() -> None:
    """SERVE.md documents no role list: a template may know `tool` or `developer`."""
    payload = json.dumps([{"role": r, "content": "x"} for r in ("system", "tool", "developer")])
    assert len(parse_request(submit(payload.encode(), "chat=1")).messages) == 3


@pytest.mark.parametrize(
    "value",
    ["%ZZ%", "%", "ab%", "%4", "%4g", "a%zz", "%%41", "%FF", "%C3", "%ED%A0%80", ""],
    ids=repr,
)
def test_bad_stop_values_are_bad_requests(value: str) -> None:
    exc = refused(submit(b"hello", f"stop={value}"))
    assert exc.code == "BAD_REQUEST" and exc.request_id == "r1", exc.message


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("%0A%0A", "\n\n"),
        ("%20never", " never"),
        ("%25", "%"),
        ("a+b", "a+b"),
        ("%c3%a9", "é"),
        ("é", "é"),
        ("%F0%9F%99%82", "🙂"),
        ("d", "d"),
    ],
)
def test_valid_stop_escapes_still_parse(value: str, text: str) -> None:
    assert parse_request(submit(b"hello", f"stop={value}", "stop=x")).stop == (text, "x")


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30))
def test_every_encoded_stop_string_parses_back(text: str) -> None:
    frame_bytes = encode_submit(Submit("r1", prompt="p", stop=(text,)))
    header, _, rest = frame_bytes.partition(b"\n")
    words = header.decode().split()
    frame = Frame(words[0], tuple(words[1:]), rest[:-1])
    assert parse_request(frame).stop == (text,)


def test_bad_escape_in_spec_is_the_rule_the_code_applies() -> None:
    assert re.search(r"every `%` must start an escape of two hex digits", SPEC)


def test_error_text_that_is_not_unicode_is_still_sendable() -> None:
    line = encode_text_line("ERROR", "-", "INTERNAL", text="bad \ud800 text\nsecond line")
    assert line.count(b"\n") == 1 and line.startswith(b"ERROR - INTERNAL bad ")
    line.decode("utf-8")


def test_deep_json_reply_from_a_daemon_is_a_frame_error_not_a_crash() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_response(Frame("STATUS", ("200000",), b"[" * 100_000 + b"]" * 100_000))
    assert info.value.code == "BAD_FRAME"
