"""The two pure halves of a remote model's request: the OpenAI body it is sent
(serve.remote_body) and the text its streamed chunks fold back into (remote.chunks), which
the daemon's own output splitter must read as a local model's reasoning and calls."""

from __future__ import annotations

import json

import pytest

from colibrid.engine.grammar import Grammar
from colibrid.engine.sampling import SamplingParams
from colibrid.errors import RequestError
from colibrid.http.parsing import REMOTE_FEATURES
from colibrid.http.splitter import make_splitter
from colibrid.remote.chunks import ChunkReader
from colibrid.remote.spec import RemoteSpec, base_url
from colibrid.serve.remote_body import OPEN_CONTEXT, remote_call
from colibrid.serve.requests import Asked, GenerateRequest

SPEC = RemoteSpec("team", "http://127.0.0.1:8080", "glm")
HI = ({"role": "user", "content": "hi"},)


def request(**kw) -> GenerateRequest:
    params = kw.pop("params", SamplingParams(max_tokens=OPEN_CONTEXT, temperature=0.0))
    return GenerateRequest(id="r1", client=1, params=params, messages=HI, **kw)


def test_the_body_carries_only_what_asks_for_something() -> None:
    route, body = remote_call(request(), SPEC)
    assert route == "chat/completions"
    assert body == {
        "model": "glm",
        "temperature": 0.0,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    params = SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        seed=3,
        stop=("x",),
        repeat_penalty=1.1,
        repeat_last_n=32,
        frequency_penalty=0.2,
        min_p=0.05,
    )
    _, body = remote_call(request(params=params), SPEC)
    for name, value in {
        "max_tokens": 7,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 3,
        "stop": ["x"],
        "repeat_penalty": 1.1,
        "repetition_penalty": 1.1,
        "repeat_last_n": 32,
        "frequency_penalty": 0.2,
        "min_p": 0.05,
    }.items():
        assert body[name] == value, name
    route, body = remote_call(
        GenerateRequest(id="r", client=1, params=SamplingParams(), prompt="once"), SPEC
    )
    assert route == "completions" and body["prompt"] == "once" and "messages" not in body


def test_tools_and_a_json_answer_go_as_the_client_asked() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"type": "function", "id": None, "function": {"name": "f", "arguments": {"a": 1}}}
    history = (*HI, {"role": "assistant", "content": "", "tool_calls": [call]})
    asked = Asked({"type": "function", "function": {"name": "f"}}, {"type": "object"})
    plan = GenerateRequest(
        id="r", client=1, params=SamplingParams(), messages=history, tools=(tool,), asked=asked
    )
    _, body = remote_call(plan, SPEC)
    assert body["tools"] == [tool] and body["tool_choice"] == asked.tool_choice
    assert body["response_format"] == {"type": "json_object"}
    sent = body["messages"][1]["tool_calls"][0]
    assert sent["id"] == "call_1_0" and json.loads(sent["function"]["arguments"]) == {"a": 1}
    schema = {"type": "object", "properties": {"c": {"type": "string"}}}
    _, body = remote_call(request(grammar=Grammar.json_schema(schema)), SPEC)
    assert body["response_format"]["json_schema"]["schema"] == schema


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"grammar": Grammar.lark('start: "a"')}, "a lark grammar cannot be sent"),
        ({"grammar": Grammar.regex("a+")}, "a regex grammar cannot be sent"),
        ({"params": SamplingParams(logprobs=2)}, "logprobs: not available"),
        ({"profile": "code"}, "profile: usage profiles"),
        ({"speculate": "ngram"}, "speculate/draft_max"),
    ],
)
def test_what_has_no_openai_field_is_refused_by_name(kw: dict, needle: str) -> None:
    with pytest.raises(RequestError, match=needle):
        remote_call(request(**kw), SPEC)


def test_reasoning_and_calls_fold_into_what_the_splitter_reads() -> None:
    reader = ChunkReader()
    deltas = [
        {"reasoning_content": "Paris is "},
        {"reasoning_content": "asked."},
        {"content": "Let me check."},
        {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "get_", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"name": "weather", "arguments": '{"ci'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]},
    ]
    text = "".join(reader.feed({"choices": [{"index": 0, "delta": d}]}) for d in deltas)
    reader.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    reader.feed({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 12}})
    text += reader.finish()
    assert reader.finish_reason == "tool_calls" and reader.usage.completion_tokens == 12
    splitter = make_splitter(REMOTE_FEATURES)
    pieces = splitter.feed(text)
    rest, calls = splitter.finish(whole=True)
    pieces += rest
    joined: dict[str, str] = {}
    for kind, piece in pieces:
        joined[kind] = joined.get(kind, "") + piece
    assert joined.get("reasoning") == "Paris is asked."
    assert joined.get("content", "").strip() == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_base_urls() -> None:
    assert base_url("HTTP://h:1/v1/") == "http://h:1"
    assert base_url("https://h/proxy/v1") == "https://h/proxy"
    for bad in ("h:1", "http://", "http://h:1/?x=1"):
        with pytest.raises(Exception, match="URL|query"):
            base_url(bad)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("stop_reason", "\n\n", "\n\n"),  # vLLM (and colibrid's OpenAI API)
        ("matched_stop", "END", "END"),  # SGLang
        ("stop_reason", 128009, None),  # a stop token's id: no stop string
        ("stop_reason", None, None),  # the model's own end
    ],
)
def test_the_stop_string_the_endpoint_names_is_kept(
    field: str, value: object, named: str | None
) -> None:
    reader = ChunkReader()
    reader.feed({"choices": [{"index": 0, "delta": {"content": "Paris"}, "finish_reason": None}]})
    reader.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", field: value}]})
    assert (reader.finish_reason, reader.stop_string) == ("stop", named)
