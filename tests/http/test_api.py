"""The real daemon over HTTP with the official `openai` and `anthropic` clients and raw
httpx: chat (streaming or not), completions, models, seeds, stop, length, SSE framing,
error bodies, equality with the SERVE protocol, 20 concurrent streams, metrics."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from colibri_protocol.messages import Data, Submit
from daemon_helpers import serving_http

from colibri_cli.client import Client

MODEL = "model"  # the chat_model fixture's directory name == the served model id
HI = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def home(chat_model: Path, tmp_path_factory):
    yield from serving_http(
        tmp_path_factory.mktemp("h"),
        chat_model,
        max_queue=32,
        max_active=4,
        profile_save_s=30.0,
    )


@pytest.fixture(scope="module")
def oai(home):
    return openai.OpenAI(base_url=home.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(oai, **kw):
    return oai.chat.completions.create(model=MODEL, messages=HI, **{"temperature": 0, **kw})


def test_models(oai) -> None:
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nope")


def test_chat_non_streaming_and_length(oai) -> None:
    r = chat(oai, max_tokens=6)
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert isinstance(r.choices[0].message.content, str)
    r2 = chat(oai, max_completion_tokens=6)
    assert r2.choices[0].message.content == r.choices[0].message.content
    # the same prompt again is answered from the prompt cache, nothing prefilled
    assert r2.usage.prompt_tokens_details.cached_tokens == r2.usage.prompt_tokens


def test_next_turn_reuses_the_conversation_kv(oai) -> None:
    question = [{"role": "user", "content": "Name a large river."}]
    first = oai.chat.completions.create(model=MODEL, messages=question, max_tokens=5, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    turn2 = question + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And another one?"},
    ]
    second = oai.chat.completions.create(model=MODEL, messages=turn2, max_tokens=5, temperature=0)
    # everything up to the first answer's start is reused (the template renders the
    # answer's turn header differently from the generation prompt's)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - 4 <= cached < second.usage.prompt_tokens


def test_chat_streaming_equals_non_streaming(oai) -> None:
    whole = chat(oai, max_tokens=8).choices[0].message.content
    chunks = list(chat(oai, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_seed_repeats_and_stop(oai) -> None:
    a = chat(oai, max_tokens=10, temperature=1.0, seed=1234).choices[0].message.content
    b = chat(oai, max_tokens=10, temperature=1.0, seed=1234).choices[0].message.content
    assert a == b
    greedy = chat(oai, max_tokens=10).choices[0].message.content
    cut = greedy[len(greedy) // 2 :][:2]
    assert cut
    r = chat(oai, max_tokens=10, stop=[cut])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == greedy[: greedy.index(cut)]
    assert (
        chat(oai, max_tokens=10, stop=cut).choices[0].message.content
        == r.choices[0].message.content
    )


def test_completions(oai) -> None:
    r = oai.completions.create(model=MODEL, prompt="Paris is", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    streamed = oai.completions.create(
        model=MODEL, prompt="Paris is", max_tokens=5, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_http_greedy_equals_serve(home, oai) -> None:
    http_text = chat(oai, max_tokens=12).choices[0].message.content
    with Client.connect(home.socket, timeout_s=30) as client:
        events = client.generate(Submit("g", messages=tuple(HI), max_tokens=12))
        serve_text = "".join(e.text for e in events if isinstance(e, Data))
    assert http_text == serve_text
    raw = oai.completions.create(model=MODEL, prompt="Paris is", max_tokens=8, temperature=0)
    with Client.connect(home.socket, timeout_s=30) as client:
        events = client.generate(Submit("r", prompt="Paris is", max_tokens=8))
        assert raw.choices[0].text == "".join(e.text for e in events if isinstance(e, Data))


def test_sse_framing(home) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream("POST", home.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        assert json.loads(event[6:])["object"] == "chat.completion.chunk"


@pytest.mark.parametrize(
    "method,path,body,status,code",
    [
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": HI, "n": 9}, 400, None),
        (
            "POST",
            "/v1/chat/completions",
            {"model": "other", "messages": HI},
            404,
            "model_not_found",
        ),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, None),
        (
            "POST",
            "/v1/chat/completions",
            {"model": MODEL, "messages": HI, "temperature": "x"},
            400,
            None,
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "Paris " * 300}]},
            400,
            "context_length_exceeded",
        ),
        ("POST", "/v1/completions", {"model": MODEL}, 400, None),
        ("GET", "/v1/nothing", None, 404, None),
        ("GET", "/v1/chat/completions", None, 405, None),
    ],
)
def test_error_bodies(home, method, path, body, status, code) -> None:
    r = httpx.request(method, home.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code:
        assert error["code"] == code


def test_bad_json_and_streamed_context_error(home) -> None:
    r = httpx.post(
        home.url + "/v1/chat/completions",
        content=b"{nope",
        headers={"content-type": "application/json"},  # without it: 415, before any parsing
        timeout=30,
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    body = {
        "model": MODEL,
        "stream": True,
        "messages": [{"role": "user", "content": "Paris " * 300}],
    }
    r = httpx.post(home.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_anthropic_messages(home, oai) -> None:
    client = anthropic.Anthropic(base_url=home.url, api_key="unused", max_retries=0)
    m = client.messages.create(
        model=MODEL, max_tokens=6, messages=HI, extra_body={"temperature": 0}
    )
    assert m.type == "message" and m.stop_reason == "max_tokens"
    assert m.usage.output_tokens == 6
    assert m.content[0].text == chat(oai, max_tokens=6).choices[0].message.content
    with client.messages.stream(
        model=MODEL, max_tokens=6, messages=HI, extra_body={"temperature": 0}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == m.content[0].text and final.stop_reason == "max_tokens"
    # a stop sequence names itself; with several, the one that ended the text
    whole = m.content[0].text
    cut = whole[len(whole) // 2 :][:2]
    assert cut
    for kw in ({}, {"stream": True}):
        ask = dict(
            model=MODEL,
            max_tokens=6,
            messages=HI,
            extra_body={"temperature": 0},
            stop_sequences=["never appears", cut],
        )
        if kw:
            with client.messages.stream(**ask) as stream:
                s = stream.get_final_message()
        else:
            s = client.messages.create(**ask)
        assert s.stop_reason == "stop_sequence" and s.stop_sequence == cut
        assert s.content[0].text == whole[: whole.index(cut)]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=0, messages=HI)


def test_health_metrics_openapi(home, oai) -> None:
    assert httpx.get(home.url + "/health").json()["status"] == "ok"
    chat(oai, max_tokens=2)
    text = httpx.get(home.url + "/metrics").text
    for name in (
        "colibri_http_requests_total",
        "colibri_generated_tokens_total",
        "colibri_decode_tokens_per_second",
        "colibri_expert_hit_rate",
        "colibri_expert_bytes_read_total",
        'colibri_tier_experts{tier="ram"}',
    ):
        assert name in text
    spec = httpx.get(home.url + "/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"]
    # what the API refuses, the description refuses too (an empty model or message list)
    for path in ("/v1/chat/completions", "/v1/messages"):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        props = body["schema"]["properties"]
        assert props["model"]["minLength"] == 1 and props["messages"]["minItems"] == 1
        r = httpx.post(home.url + path, json={"model": "", "messages": [], "max_tokens": 1})
        assert r.status_code in (400, 404), r.text


def test_a_405_says_what_is_allowed(home) -> None:
    r = httpx.get(home.url + "/v1/chat/completions", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = httpx.post(home.url + "/health", json={}, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "GET"


def test_twenty_concurrent_streams(oai) -> None:
    prompts = [f"Say {w}" for w in ("Paris", "café", "France", "naïve")]

    def one(prompt: str) -> str:
        stream = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=12,
            temperature=0,
            stream=True,
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    expected = {p: one(p) for p in prompts}
    results: dict[int, str] = {}

    def worker(i: int) -> None:
        results[i] = one(prompts[i % 4])

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    wall = time.monotonic() - started
    assert len(results) == 20
    assert all(results[i] == expected[prompts[i % 4]] for i in range(20))
    print(f"20 concurrent streams: {wall:.2f} s")


def test_a_max_tokens_past_the_context_is_clamped(home) -> None:
    """As llama-server does (and the SERVE protocol): not a 400, an answer that stops at
    the end of the context with finish_reason "length"."""
    body = {"model": MODEL, "messages": HI, "max_tokens": 100_000, "temperature": 0}
    r = httpx.post(home.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    doc = r.json()
    usage = doc["usage"]
    assert doc["choices"][0]["finish_reason"] in ("length", "stop")
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 256


def test_ps_and_status_show_the_http_address(home) -> None:
    assert home.url in home.colibri("ps").stdout
    assert home.url in home.colibrid("status").stdout
