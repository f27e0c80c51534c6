"""The edge rules of the keyless loopback API against the real daemon: only loopback
`Host` and `Origin` (DNS rebinding, cross-site pages), only JSON bodies (no CORS simple
requests), bounded JSON nesting, a deadline for headers and body, request validation that
matches SERVE, and /health answering while a large body is decoded."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from colibri_protocol.messages import Submit
from daemon_helpers import Home, free_port

from colibri_cli.client import Client, ClientError
from colibrid.http import errors
from colibrid.http.gate import is_loopback_origin, split_host

MODEL = "model"
HI = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0}
KEY = "sekret"


def _serving(folder: Path, chat_model: Path, **settings: object):
    """The real daemon with the HTTP API on a free loopback port; stopped at the end."""
    port = free_port()
    h = Home(folder, chat_model, http=f"127.0.0.1:{port}", shutdown_grace_s=1.0, **settings)
    h.start()
    h.url, h.port = f"http://127.0.0.1:{port}", port
    yield h
    h.close()


@pytest.fixture(scope="module")
def home(chat_model: Path, tmp_path_factory):
    yield from _serving(tmp_path_factory.mktemp("g"), chat_model, http_body_timeout_s=1.0)


@pytest.fixture(scope="module")
def keyed(chat_model: Path, tmp_path_factory):
    yield from _serving(
        tmp_path_factory.mktemp("k"),
        chat_model,
        http_api_key=KEY,
        http_cors="https://ok.example",
    )


@pytest.fixture(scope="module")
def oai(home):
    return openai.OpenAI(base_url=home.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(home: Home, body: bytes | dict, **headers: str) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"content-type": "application/json", **headers}
    return httpx.post(home.url + "/v1/chat/completions", content=data, headers=hdrs, timeout=60)


def requests_done(home: Home) -> int:
    with Client.connect(home.socket, timeout_s=30) as client:
        return client.query("STATUS")["requests_done"]


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---- pure rules ------------------------------------------------------------------------------
def test_host_and_origin_parsing() -> None:
    assert split_host("LocalHost:8080") == "localhost"
    assert split_host("[::1]:80") == "::1" and split_host("[::1]") == "::1"
    assert split_host("[::1]x") is None and split_host("a:b") is None and split_host("") is None
    for good in ("http://localhost:3000", "http://127.0.0.1", "https://[::1]:8443"):
        assert is_loopback_origin(good), good
    for bad in ("null", "https://evil.example", "http://localhost.evil.example", "file://"):
        assert not is_loopback_origin(bad), bad
    assert not is_loopback_origin("http://localhost/path")


def test_io_and_template_errors_map_to_http() -> None:
    io = errors.from_code("IO", "cannot write run/kv/abc: disk full")
    assert io.status == 500 and io.message == "cannot write run/kv/abc: disk full"
    assert errors.from_code("TEMPLATE", "bad template").status == 400


# ---- Host ------------------------------------------------------------------------------------
def test_host_must_name_the_loopback(home) -> None:
    for host in ("attacker.example", f"attacker.example:{home.port}", "127.0.0.1.nip.io", "::1"):
        for path in ("/v1/models", "/health", "/metrics"):
            r = httpx.get(home.url + path, headers={"host": host})
            assert error(r, 403)["code"] == "host_not_allowed", (host, path)
    r = post(home, CHAT, host="attacker.example")
    assert error(r, 403)["code"] == "host_not_allowed"
    for host in (f"127.0.0.1:{home.port}", "localhost", f"LOCALHOST:{home.port}", "[::1]"):
        assert httpx.get(home.url + "/v1/models", headers={"host": host}).status_code == 200, host
    assert httpx.get(home.url + "/v1/models", headers={"host": f"[::1]:{home.port}"}).is_success


def test_with_a_key_any_host_and_listed_origins(keyed) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    url = keyed.url + "/v1/models"
    assert httpx.get(url, headers={**auth, "host": "gpu-box.lan:8080"}).status_code == 200
    ok = httpx.get(url, headers={**auth, "origin": "https://ok.example"})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://ok.example"
    r = httpx.get(url, headers={**auth, "origin": "https://evil.example"})
    assert error(r, 403)["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    chat = keyed.url + "/v1/chat/completions"
    pre = httpx.options(chat, headers={"origin": "https://ok.example"})
    assert pre.status_code == 204 and "POST" in pre.headers["access-control-allow-methods"]
    assert httpx.options(chat, headers={"origin": "https://evil.example"}).status_code == 403


# ---- Origin and Content-Type -----------------------------------------------------------------
def test_origin_must_be_a_loopback_page(home) -> None:
    url = home.url + "/v1/models"
    for origin in ("https://evil.example", "null", f"http://localhost.evil.example:{home.port}"):
        r = httpx.get(url, headers={"origin": origin})
        assert error(r, 403)["code"] == "origin_not_allowed", origin
    assert error(post(home, CHAT, origin="https://evil.example"), 403)["code"] == (
        "origin_not_allowed"
    )
    for origin in ("http://localhost:3000", f"http://127.0.0.1:{home.port}", "http://[::1]"):
        assert httpx.get(url, headers={"origin": origin}).status_code == 200, origin


def test_only_json_bodies_start_a_generation(home) -> None:
    before = requests_done(home)
    body = json.dumps(CHAT).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""):
        r = post(home, body, **{"content-type": kind})
        assert error(r, 415)["code"] == "unsupported_media_type", kind
    # the cross-site "simple request" of the issue: refused before any body is read
    r = post(home, body, **{"content-type": "text/plain", "origin": "https://evil.example"})
    assert r.status_code == 403
    assert requests_done(home) == before  # nothing reached the scheduler
    r = post(home, body, **{"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text
    assert requests_done(home) == before + 1


# ---- JSON depth and the body deadline ----------------------------------------------------------
def test_deep_json_is_a_400_and_the_daemon_carries_on(home) -> None:
    for data in (b"[" * 100_000, b'{"model": "model", "messages": ' + b"[" * 70 + b"]" * 70 + b"}"):
        err = error(post(home, data), 400)
        assert err["type"] == "invalid_request_error" and "deep" in err["message"]
    assert "not valid JSON" in error(post(home, b"{nope"), 400)["message"]
    assert error(post(home, b'{"a": "\xff"}'), 400)["type"] == "invalid_request_error"
    assert error(post(home, b'{"seed": ' + b"9" * 5000 + b"}"), 400)
    assert post(home, CHAT).status_code == 200


def test_a_slow_body_gets_408_and_the_connection_closes(home) -> None:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", home.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\n"
            b"content-type: application/json\r\ncontent-length: 4000000\r\n\r\n"
            b'{"model": '
        )
        reply = b""
        while chunk := sock.recv(65536):  # b"": the daemon closed the connection
            reply += chunk
    elapsed = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert b'"request_timeout"' in reply
    assert 0.9 < elapsed < 5, elapsed


def test_slow_headers_are_cut_off(home) -> None:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", home.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        closed = False
        while time.monotonic() - started < 6:
            try:
                sock.sendall(b"x-drip: 1\r\n")
            except OSError:
                closed = True
                break
            sock.settimeout(0.25)
            try:
                if sock.recv(65536) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except OSError:  # the server's close can arrive as a reset: cut off all the same
                closed = True
                break
    assert closed and time.monotonic() - started < 4


# ---- validation parity with SERVE ----------------------------------------------------------------
def test_seed_range_is_serves(home, oai) -> None:
    for seed in (-1, 2**64, 2**70, True, 1.5, "1"):
        r = post(home, {**CHAT, "seed": seed})
        assert error(r, 400)["param"] == "seed", seed
    for seed in (-1, 2**64):
        with Client.connect(home.socket, timeout_s=30) as client:
            with pytest.raises(ClientError) as err:
                list(client.generate(Submit("s", messages=tuple(HI), max_tokens=1, seed=seed)))
        assert err.value.code == "BAD_REQUEST"
    top = oai.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=2, temperature=1.0, seed=2**64 - 1
    )
    assert top.choices[0].finish_reason in ("length", "stop")
    with Client.connect(home.socket, timeout_s=30) as client:
        list(client.generate(Submit("t", messages=tuple(HI), max_tokens=1, seed=2**64 - 1)))


def test_shapes_and_bools_are_checked(home, oai) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=HI, tool_choice={"x": 1})  # type: ignore[arg-type]
    assert err.value.body["param"] == "tool_choice"
    for bad, param in (
        ({"messages": [{"role": "user", "content": None}]}, "messages[0]"),
        ({"messages": [{"role": "system"}, *HI]}, "messages[0]"),
        ({"messages": [*HI, {"role": "tool", "content": None}]}, "messages[1]"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": True}, "temperature"),
        ({"n": True}, "n"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
    ):
        assert error(post(home, {**CHAT, **bad}), 400)["param"] == param, bad
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}]
    history.append({"role": "tool", "tool_call_id": "c1", "content": "sunny"})
    assert post(home, {**CHAT, "messages": history}).status_code == 200
    msgs = {"model": MODEL, "max_tokens": 2, "messages": HI}
    url = home.url + "/v1/messages"
    for choice in ({"x": 1}, {"type": "tool"}, "auto"):
        r = httpx.post(url, json={**msgs, "tool_choice": choice})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", choice
    assert httpx.post(url, json={**msgs, "tool_choice": {"type": "none"}}).status_code == 200
    r = httpx.post(url, json={**msgs, "messages": [{"role": "user", "content": None}]})
    assert r.status_code == 400 and r.json()["type"] == "error"


# ---- the loop stays free ------------------------------------------------------------------------
def test_health_answers_while_a_big_body_is_decoded(home) -> None:
    """A 3.9 MB chat body of many content parts: decoding, the depth walk and the
    per-part checks run in a worker thread. temperature 5 fails after all of them, so
    what is timed is the decoding, not the tokenizer."""
    parts = [{"type": "text", "text": "ab"}] * 120_000
    body = json.dumps({**CHAT, "temperature": 5, "messages": [{"role": "user", "content": parts}]})
    assert 3.5e6 < len(body) < 4e6
    done, answer, latencies = threading.Event(), {}, []

    def big() -> None:
        answer["r"] = post(home, body.encode())
        done.set()

    with httpx.Client(base_url=home.url, timeout=30) as client:
        client.get("/health")  # a warm connection
        thread = threading.Thread(target=big)
        thread.start()
        while not done.is_set():
            started = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.005)
        thread.join()
    assert error(answer["r"], 400)["param"] == "temperature"
    assert latencies and max(latencies) < 0.5, latencies
