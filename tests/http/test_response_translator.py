"""The Responses translator without a daemon, where the demo model cannot take it: the
output of a model that thinks (a reasoning item before the message, its events valid for
the SDK's types, its tokens counted, the reasoning kept with the stored turn), a tool
round trip's input items in the order agent frameworks send them, a failure after the
stream began, and the store's bound."""

from __future__ import annotations

from typing import Any

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from colibrid.http.parsing import Features
from colibrid.http.response_events import ResponseStream
from colibrid.http.response_store import ResponseStore
from colibrid.http.responses import input_messages, response_plan
from colibrid.serve.events import Done

EVENTS = TypeAdapter(ResponseStreamEvent)
THINKS = Features(think=True)


def stream(
    body: dict[str, Any], features: Features = THINKS
) -> tuple[ResponseStream, ResponseStore]:
    store = ResponseStore()
    plan, spec = response_plan(
        {"model": "m", **body},
        served="m",
        client=1,
        max_context=512,
        features=features,
        store=store,
    )
    return ResponseStream(plan, spec, store), store


def done(generated: int, finish: str = "stop") -> Done:
    return Done(finish, 20, generated, 4, 0.1, 0.1, 200.0, 60.0)


def run(translator: ResponseStream, pieces: list[str], end: Done) -> list[Any]:
    events = translator.start()
    for piece in pieces:
        events += translator.token(piece)
    events += translator.finish(end)
    checked = [EVENTS.validate_python({"type": name, **payload}) for name, payload in events]
    assert [e.sequence_number for e in checked] == list(range(len(checked)))
    return checked


def test_thinking_is_a_reasoning_item_before_the_message() -> None:
    translator, store = stream({"input": "Capital of France?"})
    pieces = ["<think>", "The user", " asks.", "</think>", "\n\n", "Paris", "."]
    events = run(translator, pieces, done(len(pieces)))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = Response.model_validate(events[-1].response.to_dict())
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "The user asks."
    assert message.type == "message" and final.output_text == "Paris."
    assert events[4].output_index == 0 and events[11].output_index == 1
    assert final.usage.output_tokens_details.reasoning_tokens == 2
    (turn,) = store.get(final.id)[1:]  # the question, then the answer as the next turn sees it
    assert turn == {"role": "assistant", "content": "Paris.", "reasoning_content": "The user asks."}


def test_an_empty_answer_still_has_its_message_and_a_cut_one_is_incomplete() -> None:
    translator, _ = stream({"input": "Hi"}, Features())
    events = run(translator, [], done(0))
    assert events[-1].response.output_text == "" and len(events[-1].response.output) == 1
    translator, _ = stream({"input": "Hi", "max_output_tokens": 2}, Features())
    events = run(translator, ["Hel", "lo"], done(2, "length"))
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.output[0].status == "incomplete"
    assert final.response.incomplete_details.reason == "max_output_tokens"


def test_a_failure_after_the_stream_began_is_response_failed() -> None:
    translator, store = stream({"input": "Hi"}, Features())
    events = translator.start() + translator.token("Hel")
    events += translator.failed(
        {"message": "the engine stopped", "type": "server_error", "code": "internal_error"}
    )
    checked = [EVENTS.validate_python({"type": name, **payload}) for name, payload in events]
    assert checked[-1].type == "response.failed"
    assert checked[-1].response.error.message == "the engine stopped"
    assert checked[-1].response.output[0].content[0].text == "Hel"
    assert len(store) == 0  # a failed response is not kept


def test_input_items_of_a_tool_round_trip_become_chat_turns() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather?"}],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Call it."}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Checking."}],
        },
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
        },
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Rain."},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "9:00"}],
        },
    ]
    system, user, assistant, weather, time = input_messages(items)
    assert system == {"role": "system", "content": "Be brief."}
    assert user == {"role": "user", "content": "Weather?"}
    assert assistant["content"] == "Checking." and assistant["reasoning_content"] == "Call it."
    assert [
        (c["id"], c["function"]["name"], c["function"]["arguments"])
        for c in assistant["tool_calls"]
    ] == [
        ("c1", "get_weather", {"city": "Oslo"}),
        ("c2", "get_time", {}),
    ]
    assert weather == {
        "role": "tool",
        "content": "Rain.",
        "tool_call_id": "c1",
        "name": "get_weather",
    }
    assert time["content"] == "9:00" and time["name"] == "get_time"


def test_the_store_keeps_the_most_recently_used() -> None:
    store = ResponseStore(capacity=2)
    store.keep("a", ({"role": "user", "content": "1"},))
    store.keep("b", ({"role": "user", "content": "2"},))
    assert store.get("a") is not None  # used: now the most recent
    store.keep("c", ({"role": "user", "content": "3"},))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2


def test_parallel_tool_calls_false_returns_the_first_call_only() -> None:
    tools = [{"type": "function", "name": n, "parameters": {"type": "object"}} for n in "fg"]
    text = (
        '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    for parallel, names in ((True, ["f", "g"]), (False, ["f"])):
        translator, store = stream(
            {"input": "Go.", "tools": tools, "parallel_tool_calls": parallel}, Features()
        )
        events = run(translator, [text], done(20))
        final = events[-1].response
        assert [item.name for item in final.output] == names and final.status == "completed"
        assert final.parallel_tool_calls is parallel
        (turn,) = store.get(final.id)[1:]
        assert [c["function"]["name"] for c in turn["tool_calls"]] == names
