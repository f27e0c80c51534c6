"""Admission, cancellation and the edge rules on a deliberately slow daemon: a client
that disconnects frees the engine within a token, a full queue answers 429 with
Retry-After, the API key, CORS and the body limit."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from daemon_helpers import Home, free_port, wait_for

MODEL = "model"
KEY = "sekret"
AUTH = {"authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def home(chat_model: Path, tmp_path_factory):
    port = free_port()
    h = Home(
        tmp_path_factory.mktemp("s"),
        chat_model,
        http=str(port),
        max_queue=1,
        max_active=1,
        debug_layer_delay_s=0.01,
        http_api_key=KEY,
        http_cors="https://ok.example",
        http_max_body_bytes=4000,
        shutdown_grace_s=1.0,
    )
    h.start()
    h.url = f"http://127.0.0.1:{port}"
    h.port = port
    yield h
    h.close()


def gauge(home: Home, name: str) -> float:
    for line in httpx.get(home.url + "/metrics", headers=AUTH).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(name)


def raw_stream(home: Home, max_tokens: int) -> socket.socket:
    body = json.dumps(
        # greedy: a sampled answer could stop at an end token long before max_tokens, and
        # the "running" request would then end before the test has filled the queue
        {
            "model": MODEL,
            "messages": HI,
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0,
        }
    ).encode()
    sock = socket.create_connection(("127.0.0.1", home.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        b"authorization: Bearer " + KEY.encode() + b"\r\n"
        b"content-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    return sock


def small(home: Home) -> float:
    started = time.monotonic()
    r = httpx.post(
        home.url + "/v1/chat/completions",
        headers=AUTH,
        timeout=60,
        json={"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return time.monotonic() - started


def test_disconnect_mid_stream_frees_the_engine(home) -> None:
    alone = small(home)
    sock = raw_stream(home, 200)
    got = b""
    while got.count(b"data: ") < 3:
        got += sock.recv(65536)
    assert b" 200 " in got.split(b"\r\n")[0]
    sock.close()  # mid-stream: ~200 tokens left at >= 20 ms each
    after = small(home)  # max_active = 1: it would wait for the whole stream otherwise
    assert after < alone + 1.5, (alone, after)
    assert wait_for(lambda: gauge(home, "colibri_running_requests") == 0, 5)


def test_full_queue_answers_429(home) -> None:
    running, queued = raw_stream(home, 200), None
    try:
        assert wait_for(lambda: gauge(home, "colibri_running_requests") == 1, 10)
        queued = raw_stream(home, 5)
        assert wait_for(lambda: gauge(home, "colibri_queued_requests") == 1, 10)
        r = httpx.post(
            home.url + "/v1/chat/completions",
            headers=AUTH,
            timeout=30,
            json={"model": MODEL, "messages": HI, "max_tokens": 2},
        )
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        running.close()
        if queued is not None:
            queued.close()
    assert wait_for(
        lambda: (
            gauge(home, "colibri_running_requests") == 0
            and gauge(home, "colibri_queued_requests") == 0
        ),
        10,
    )


def test_api_key(home) -> None:
    url = home.url + "/v1/models"
    assert httpx.get(url).status_code == 401
    r = httpx.get(url, headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url, headers=AUTH).status_code == 200
    assert httpx.get(url, headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(home.url + "/health").status_code == 200  # liveness needs no key


def test_cors_and_body_limit(home) -> None:
    url = home.url + "/v1/models"
    ok = httpx.get(url, headers={**AUTH, "origin": "https://ok.example"})
    assert ok.headers["access-control-allow-origin"] == "https://ok.example"
    other = httpx.get(url, headers={**AUTH, "origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    pre = httpx.options(home.url + "/v1/chat/completions", headers={"origin": "https://ok.example"})
    assert pre.status_code == 204 and "POST" in pre.headers["access-control-allow-methods"]
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(home.url + "/v1/chat/completions", headers=AUTH, json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_non_loopback_needs_a_key(chat_model: Path, tmp_path_factory) -> None:
    h = Home(tmp_path_factory.mktemp("n"), chat_model, http="0.0.0.0:1")
    try:
        result = h.colibrid("start")
        assert result.returncode == 1 and "http_api_key" in result.stderr
    finally:
        h.close()
