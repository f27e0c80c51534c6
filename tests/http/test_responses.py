"""OpenAI's Responses API (`/v1/responses`) on the real daemon serving the demo model, with
the official openai client: `responses.create` with a string, an item list and
instructions (the same greedy text as /v1/chat/completions for the same messages),
`responses.stream` (every event valid for the SDK's types, in order, numbered, adding up
to the non-streamed text), `responses.parse` with a pydantic model, a function tool round
trip (a forced call, its output sent back, the answer equal to chat's for the same turns),
`previous_response_id` continuing a stored response exactly as the whole input would,
the message tokens' logprobs (whole and streamed), and fields that are not served refused
with one line naming them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from daemon_helpers import serving_http
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

MODEL = "demo"
QUESTION = "What is the capital of France?"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER_PARAMS,
        "strict": True,
    },
    {
        "type": "function",
        "name": "get_time",
        "description": "The local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 24}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {k: t[k] for k in ("name", "description", "parameters")},
    }
    for t in TOOLS
]
SCHEMA_OF = {t["name"]: t["parameters"] for t in TOOLS}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def home(demo_container: Path, tmp_path_factory):
    yield from serving_http(
        tmp_path_factory.mktemp("responses"),
        demo_container,
        max_active=4,
    )


@pytest.fixture(scope="module")
def oai(home):
    return openai.OpenAI(base_url=home.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def create(oai, **kw: Any):  # noqa: ANN001
    return oai.responses.create(model=MODEL, **{"temperature": 0, "max_output_tokens": 40, **kw})


def chat_text(oai, messages: list[dict[str, Any]], max_tokens: int = 40) -> str:  # noqa: ANN001
    r = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].message.content


def raw_events(home, body: dict[str, Any]) -> list[Any]:  # noqa: ANN001
    """The SSE stream of `body`, each event validated against the SDK's event types."""
    events, names = [], []
    with httpx.stream(
        "POST", home.url + "/v1/responses", json={**body, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
            elif line.startswith("data: "):
                event = EVENTS.validate_python(json.loads(line[6:]))
                assert event.type == names[-1]  # the SSE name is the event's type
                events.append(event)
    assert "[DONE]" not in names
    return events


def test_create_string_items_and_instructions(oai) -> None:
    r = create(oai, input=QUESTION, metadata={"run": "a"}, user="u1")
    Response.model_validate(r.to_dict())  # every required field, of the right type
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.metadata == {"run": "a"} and r.user == "u1" and r.incomplete_details is None
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert r.output_text and r.output_text == chat_text(
        oai, [{"role": "user", "content": QUESTION}]
    )
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and 0 < u.output_tokens < 40
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens
    assert u.output_tokens_details.reasoning_tokens == 0  # the demo does not think
    # the same question as an item list: a message with input_text parts, and an easy message
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}
    ]
    for form in (items, [{"role": "user", "content": QUESTION}]):
        again = create(oai, input=form)
        assert again.output_text == r.output_text
        assert again.usage.input_tokens == r.usage.input_tokens
    # instructions are the system message, as a developer item is
    rule = "Answer with one word."
    told = create(oai, input=QUESTION, instructions=rule)
    assert told.instructions == rule
    system = [{"role": "system", "content": rule}, {"role": "user", "content": QUESTION}]
    assert told.output_text == chat_text(oai, system)
    developer = [{"role": "developer", "content": rule}, {"role": "user", "content": QUESTION}]
    assert create(oai, input=developer).output_text == told.output_text
    assert told.usage.input_tokens != r.usage.input_tokens


def test_max_output_tokens_is_incomplete(oai) -> None:
    r = create(oai, input="Tell me a long story about a dragon.", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.max_output_tokens == 5
    assert r.output[0].status == "incomplete" and r.output_text


def test_stream_events_in_order_adding_up_to_the_answer(home, oai) -> None:
    whole = create(oai, input=QUESTION)
    events = raw_events(
        home, {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 40}
    )
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert (
        events[0].response.status == "in_progress"
        and events[0].response.id == events[-1].response.id
    )
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == events[-4].text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    # the SDK's stream helper assembles the same response
    with oai.responses.stream(
        model=MODEL, input=QUESTION, temperature=0, max_output_tokens=40
    ) as stream:
        streamed = [e.type for e in stream]
        final = stream.get_final_response()
    assert streamed == kinds and final.output_text == whole.output_text
    # cut by the limit, the stream ends with response.incomplete
    cut = raw_events(home, {"model": MODEL, "input": QUESTION, "max_output_tokens": 3})
    assert cut[-1].type == "response.incomplete" and cut[-1].response.status == "incomplete"
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=40)


def test_parse_with_a_pydantic_model(oai) -> None:
    for prompt in ("Tell me about Paris.", "What do you know about Berlin?"):
        r = oai.responses.parse(
            model=MODEL, input=prompt, text_format=City, temperature=0, max_output_tokens=64
        )
        assert isinstance(r.output_parsed, City) and r.output_parsed.name
        assert r.text.format.type == "json_schema" and r.status == "completed"
    with oai.responses.stream(
        model=MODEL,
        input="Tell me about Rome.",
        text_format=City,
        temperature=0,
        max_output_tokens=64,
    ) as stream:
        assert isinstance(stream.get_final_response().output_parsed, City)
    r = create(
        oai, input="A cat, as JSON.", text={"format": {"type": "json_object"}}, max_output_tokens=80
    )
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)
    else:  # an object the model did not close within the limit
        assert r.output_text.startswith("{")


def _said(output: list[Any]) -> list[tuple[str, ...]]:
    """A Responses output as (text) and (call name, arguments) entries."""
    return [
        ("text", item.content[0].text)
        if item.type == "message"
        else ("call", item.name, json.loads(item.arguments))
        for item in output
    ]


def _chat_said(message: Any) -> list[tuple[str, ...]]:
    calls = [
        ("call", c.function.name, json.loads(c.function.arguments))
        for c in message.tool_calls or []
    ]
    return ([("text", message.content)] if message.content or not calls else []) + calls


def test_function_call_round_trip(home, oai) -> None:
    question = "What's the weather in Paris?"
    first = create(oai, input=question, tools=TOOLS, tool_choice="required", max_output_tokens=64)
    (call,) = first.output
    assert call.type == "function_call" and first.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), SCHEMA_OF[call.name])
    result = "Sunny, 24 degrees."
    turns = [
        {"role": "user", "content": question},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    answer = create(oai, input=turns, tools=TOOLS, max_output_tokens=48)
    assert answer.usage.input_tokens > first.usage.input_tokens
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": result},
        ],
        tools=CHAT_TOOLS,
        max_tokens=48,
        temperature=0,
    )
    assert _said(answer.output) == _chat_said(chat.choices[0].message)
    # a named tool, streamed: the call's events, its arguments those of the call made whole
    named = {"type": "function", "name": "get_time"}
    body = {"model": MODEL, "input": question, "tools": TOOLS, "tool_choice": named}
    whole = create(oai, **{k: v for k, v in body.items() if k != "model"}, max_output_tokens=64)
    events = raw_events(home, {**body, "temperature": 0, "max_output_tokens": 64})
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (made,) = whole.output
    assert made.name == events[-2].item.name == "get_time"
    assert made.arguments == events[3].delta == events[4].arguments == events[-2].item.arguments


def test_previous_response_id_continues_the_stored_conversation(home, oai) -> None:
    first = create(oai, input="Name a large river.", max_output_tokens=12)
    follow = "And another one?"
    second = create(oai, input=follow, previous_response_id=first.id, max_output_tokens=12)
    assert second.previous_response_id == first.id and second.store is True
    whole = [
        {"role": "user", "content": "Name a large river."},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": follow},
    ]
    again = create(oai, input=whole, max_output_tokens=12)
    assert second.output_text == again.output_text
    assert second.usage.input_tokens == again.usage.input_tokens
    # the earlier turns came from the prompt cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 4
    # a chain: the third turn continues the second, which continued the first
    third = create(oai, input="And a third?", previous_response_id=second.id, max_output_tokens=8)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    # store: false is not kept; an unknown id is a 400 naming the field
    unkept = create(oai, input="Hi", store=False, max_output_tokens=4)
    assert unkept.store is False
    for missing in (unkept.id, "resp_nope"):
        with pytest.raises(openai.BadRequestError) as info:
            create(oai, input="Go on.", previous_response_id=missing)
        assert info.value.body["param"] == "previous_response_id"
        assert "no stored response" in info.value.body["message"]


@pytest.mark.parametrize(
    "extra,param,words",
    [
        ({"background": True}, "background", "foreground"),
        ({"truncation": "auto"}, "truncation", "never truncated"),
        ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice", "'file_search' is not supported"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "chat template"),
        ({"include": ["file_search_call.results"]}, "include", "message.output_text.logprobs"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "not served"),
        ({"text": {"verbosity": "low"}}, "text", "verbosity"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options", "obfuscated"),
        ({"top_logprobs": 50}, "top_logprobs", "[0, 20]"),
        ({"service_tier": "flex"}, "service_tier", "one tier"),
        ({"max_tool_calls": 3}, "max_tool_calls", "built-in"),
        ({"metadata": {"k": 5}}, "metadata", "string values"),
        ({"frobnicate": 1}, "frobnicate", "not a field"),
        ({"temperature": 3}, "temperature", "[0, 2]"),
        ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "'item_reference'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "'input_image' part is not supported",
        ),
        ({"input": []}, "input", "non-empty"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
            "text",
            "text.format.schema",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
            "nope",
        ),
    ],
)
def test_fields_not_served_are_400_in_one_line(home, extra, param, words) -> None:  # noqa: ANN001
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra}
    r = httpx.post(home.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert "\n" not in error["message"] and error["type"] == "invalid_request_error"


def test_accepted_defaults_and_ignored_identifiers(oai) -> None:
    """The values that mean what colibri does anyway are accepted, and change nothing."""
    plain = create(oai, input=QUESTION, max_output_tokens=8)
    same = create(
        oai,
        input=QUESTION,
        max_output_tokens=8,
        background=False,
        truncation="disabled",
        include=[],
        service_tier="auto",
        reasoning={},
        parallel_tool_calls=True,
        store=True,
        safety_identifier="someone",
        prompt_cache_key="k",
        text={"format": {"type": "text"}},
        tool_choice="auto",
    )
    assert same.output_text == plain.output_text and same.safety_identifier == "someone"


def test_logprobs_of_the_message_tokens(home, oai) -> None:
    ask = {"input": QUESTION, "max_output_tokens": 8, "top_logprobs": 2}
    r = create(oai, **ask, include=["message.output_text.logprobs"])
    entries = r.output[0].content[0].logprobs
    assert len(entries) == r.usage.output_tokens
    assert "".join(e.token for e in entries) == r.output_text
    for e in entries:  # greedy: the chosen token is the likeliest alternative
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.logprob == e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    events = raw_events(home, {"model": MODEL, "temperature": 0, **ask})
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
