"""The sans-IO codec: framing, recovery after errors, round trips, and the spec table."""

from __future__ import annotations

from pathlib import Path

from colibri_protocol.codec import (
    MAX_PAYLOAD_BYTES,
    Frame,
    FrameDecoder,
    request_payload_length,
    response_payload_length,
)
from colibri_protocol.errors import CODES, ProtocolError
from colibri_protocol.messages import (
    Data,
    Done,
    Submit,
    encode_data,
    encode_done,
    encode_submit,
    parse_request,
    parse_response,
)
from hypothesis import given, settings
from hypothesis import strategies as st

SPEC = (Path(__file__).resolve().parents[2] / "protocol" / "SERVE.md").read_text()


def feed_all(data: bytes, rule=request_payload_length, chunk: int | None = None) -> list:
    decoder = FrameDecoder(rule)
    if chunk is None:
        return decoder.feed(data)
    out = []
    for i in range(0, len(data), chunk):
        out += decoder.feed(data[i : i + chunk])
    return out


def test_every_error_code_is_documented() -> None:
    missing = [code for code in CODES if f"`{code}`" not in SPEC]
    assert not missing


def test_payload_with_newlines_and_crlf() -> None:
    frames = feed_all(b"SUBMIT a 5 max_tokens=2\r\nx\ny\nz\r\nping\r\n")
    assert frames == [Frame("SUBMIT", ("a", "5", "max_tokens=2"), b"x\ny\nz"), Frame("PING")]


def test_byte_at_a_time_equals_all_at_once() -> None:
    data = b"SUBMIT a 3\nabc\nSTATUS\nSUBMIT b 2\nxyz\nPING\n"

    def key(items: list) -> list:
        return [i.code if isinstance(i, ProtocolError) else i for i in items]

    assert key(feed_all(data, chunk=1)) == key(feed_all(data))


def test_wrong_count_is_reported_and_the_stream_recovers() -> None:
    items = feed_all(b"SUBMIT y 2\nabc\nPING\n")
    assert isinstance(items[0], ProtocolError) and items[0].request_id == "y"
    assert items[1:] == [Frame("PING")]


def test_long_line_is_skipped_once() -> None:
    decoder = FrameDecoder(request_payload_length, max_line=16)
    items = decoder.feed(b"X" * 40) + decoder.feed(b"Y" * 40 + b"\nPING\n")
    assert [type(i) for i in items] == [ProtocolError, Frame]
    assert items[0].code == "LINE_TOO_LONG"


def test_oversized_payload_breaks_the_decoder() -> None:
    decoder = FrameDecoder(request_payload_length)
    items = decoder.feed(f"SUBMIT a {MAX_PAYLOAD_BYTES + 1}\nPING\n".encode())
    assert items[0].code == "TOO_LARGE" and decoder.broken
    assert decoder.feed(b"PING\n") == []


def test_invalid_utf8_line() -> None:
    items = feed_all(b"\xff\xfe\nPING\n")
    assert items[0].code == "BAD_FRAME" and items[1] == Frame("PING")


def native(prompt: bytes, grammar: bytes = b"", opts: str = "") -> bytes:
    """A native SUBMIT whose payload is `prompt` then `grammar` (gbytes= counts it)."""
    gbytes = f" gbytes={len(grammar)}" if grammar else ""
    return f"SUBMIT a {len(prompt + grammar)}{gbytes}{opts}\n".encode() + prompt + grammar + b"\n"


def test_upstream_submit_carries_its_grammar_after_the_prompt() -> None:
    (frame,) = feed_all(b'SUBMIT 9 1 2 4 0.5 0.9 14\nhi{"regex":"a+"}\n')
    assert frame.payload == b'hi{"regex":"a+"}'
    req = parse_request(frame)
    assert (req.prompt, req.grammar) == ("hi", {"regex": "a+"})
    (bad,) = feed_all(b"SUBMIT 9 1 2 4 0.5 0.9 4\nhigr{}\n")
    try:
        parse_request(bad)
    except ProtocolError as exc:
        assert exc.code == "BAD_REQUEST" and "grammar payload is not JSON" in exc.message
    else:
        raise AssertionError("a grammar that is not JSON was accepted")
    (plain,) = feed_all(b"SUBMIT 9 1 2 4 0.5 0.9\nhi\n")
    req = parse_request(plain)
    assert (req.prompt, req.max_tokens, req.temperature, req.top_p, req.conv) == (
        "hi",
        4,
        0.5,
        0.9,
        "slot1",
    )
    assert req.grammar is None


def test_native_submit_grammar_is_the_payloads_tail_and_format_json_its_shorthand() -> None:
    (frame,) = feed_all(native(b"hi", b'{"regex":"a+"}'))
    assert parse_request(frame).grammar == {"regex": "a+"}
    (frame,) = feed_all(native(b"hi", opts=" format=json"))
    req = parse_request(frame)
    assert (req.prompt, req.grammar) == ("hi", {"json_schema": {"type": "object"}})
    for data, why in (
        (native(b"hi", opts=" format=yaml"), "bad value for format"),
        (native(b"hi", opts=" gbytes=3"), "gbytes=3 but the payload has 2 bytes"),
        (native(b"hi", b'{"a":1}'), "grammar payload must be one of"),
        (native(b"hi", b'{"lark":""}'), "lark must be a non-empty string"),
        (native(b"hi", b'{"json_schema":1}'), "json_schema must be a JSON object"),
        (native(b"hi", b'{"regex":"a"}', " format=json"), "not both"),
        (native(b"hi", b"\xff\xfe\xfd"), "grammar payload is not valid UTF-8"),
    ):
        (frame,) = feed_all(data)
        try:
            parse_request(frame)
        except ProtocolError as exc:
            assert exc.code == "BAD_REQUEST" and why in exc.message, (data, exc.message)
        else:
            raise AssertionError(f"accepted {data!r}")


texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    prompt=texts,
    stops=st.lists(texts.filter(bool), max_size=3),
    max_tokens=st.integers(1, 10**6),
    temperature=st.floats(0, 5),
    seed=st.none() | st.integers(0, 2**64 - 1),
    chat=st.booleans(),
    chunk=st.integers(1, 7),
    grammar=st.none()
    | st.builds(lambda t: {"regex": t}, texts.filter(bool))
    | st.builds(lambda t: {"json_schema": {"type": "object", "title": t}}, texts),
)
def test_submit_round_trip(
    prompt, stops, max_tokens, temperature, seed, chat, chunk, grammar
) -> None:
    messages = ({"role": "user", "content": prompt},) if chat else None
    req = Submit(
        "id-1",
        prompt=None if chat else prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        stop=tuple(stops),
        conv="c1",
        profile="code",
        grammar=grammar,
    )
    (frame,) = feed_all(encode_submit(req), chunk=chunk)
    back = parse_request(frame)
    assert back.prompt == req.prompt and back.messages == req.messages
    assert back.grammar == grammar
    assert back.stop == req.stop and back.seed == seed and back.max_tokens == max_tokens
    assert back.temperature == float(f"{temperature:g}")


@settings(max_examples=100, deadline=None)
@given(text=texts)
def test_data_and_done_round_trip(text: str) -> None:
    done = Done("r", 3, 1.5, 99.0, 0.25, 7, True, {"finish": "length", "cached": "2"})
    frames = feed_all(encode_data("r", text) + encode_done(done), rule=response_payload_length)
    assert parse_response(frames[0]) == Data("r", text)
    back = parse_response(frames[1])
    assert (back.emitted, back.prompt_tokens, back.finish, back.extras["cached"]) == (
        3,
        7,
        "length",
        "2",
    )


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300), chunk=st.integers(1, 64))
def test_decoder_never_raises_on_garbage(data: bytes, chunk: int) -> None:
    for item in feed_all(data + b"\nPING\n", chunk=chunk):
        assert isinstance(item, (Frame, ProtocolError))
        if isinstance(item, Frame):
            try:
                parse_request(item)
            except ProtocolError as exc:
                assert exc.code in CODES
