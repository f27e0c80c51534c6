"""Tools on `auto` and the tool-result turn through the real daemon, with the clients
people run: an agent loop (a call, its result, the answer) over the openai SDK, the
anthropic SDK and LangChain's `bind_tools`, on the demo (whose template cannot show
tools: http.tools describes them and renders the history readably) and on the demo's
weights under a template that renders tools, calls and results itself. The first step
forces the call (`tool_choice` required / any / a named tool), so that a call is
certain; the result turn leaves the choice on auto, where the model may answer or call
again: either outcome must be well-formed (the auto grammar). Also the SDKs' stream
helpers assembling the streamed calls, Anthropic's `count_tokens` against the prompt a
generation really had, and its cache usage fields."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from daemon_helpers import Home, start_http
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from colibrid.engine.tokenizer import TextCodec
from colibrid.http.parsing import TOOL_OPEN, Features
from colibrid.http.structured import ToolChoice
from colibrid.http.tools import plan_tools

MODEL = "demo"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": WEATHER_SCHEMA,
    },
}
ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": WEATHER_SCHEMA,
}
RESULT = "Sunny, 21 degrees Celsius."
GREEDY = {"temperature": 0}  # the anthropic SDK has no `temperature` argument any more
# A Hermes/Qwen-style template: tools listed in the system turn, calls as `<tool_call>`
# JSON, results as `<tool_response>` in a user turn (what Qwen2.5's template renders).
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions:\n{% for t in tools %}"
    "{{ t | tojson }}\n{% endfor %}Call one as <tool_call>\n"
    '{"name": NAME, "arguments": ARGS}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _start(model: Path, root: Path) -> Home:
    return start_http(root, model, max_active=4)


@pytest.fixture(scope="module")
def home(demo_container: Path, tmp_path_factory):
    h = _start(demo_container, tmp_path_factory.mktemp("tools"))
    yield h
    h.close()


@pytest.fixture(scope="module")
def native(demo_container: Path, tmp_path_factory):
    """The demo's weights (hard links) under a template that renders tools itself."""
    root = tmp_path_factory.mktemp("native-tools")
    model = root / "models" / MODEL
    model.mkdir(parents=True)
    for f in demo_container.iterdir():
        os.link(f, model / f.name)
    (model / "chat_template.jinja").write_text(NATIVE_TEMPLATE)
    h = _start(model, root / "home")
    yield h
    h.close()


def oai_of(h: Home) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ant_of(h: Home) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=h.url, api_key="unused", max_retries=0, timeout=120)


def well_formed(choice: Any) -> None:
    """An answer on auto is one of two things, each whole: calls (finish tool_calls,
    arguments valid for the schema, no call text left in the content) or text (no
    calls; a call opener only in an answer cut short by max_tokens)."""
    calls = choice.message.tool_calls or []
    if choice.finish_reason == "tool_calls":
        assert calls
        for call in calls:
            assert call.function.name == "get_weather" and call.id
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
        assert TOOL_OPEN not in (choice.message.content or "")
    else:
        assert not calls and choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            assert TOOL_OPEN not in choice.message.content


def assembled(client: openai.OpenAI, ask: dict[str, Any]) -> Any:
    """The answer as the SDK's stream helper assembles it from the chunks (the snapshot:
    `get_final_completion` refuses an answer cut by max_tokens, which is legitimate)."""
    with client.chat.completions.stream(**ask) as stream:
        for _ in stream:
            pass
        return stream.current_completion_snapshot


def openai_loop(client: openai.OpenAI) -> None:
    """Call (forced) -> tool result -> the answer on auto, non-streamed and streamed
    through the SDK's stream helper: both well-formed, and the same."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=64,
        temperature=0,
    )
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    ask = dict(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=48, temperature=0)
    answer = client.chat.completions.create(**ask)
    well_formed(answer.choices[0])
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and result are in
    final = assembled(client, ask)
    assert final.choices[0].finish_reason == answer.choices[0].finish_reason
    assert final.choices[0].message.content == answer.choices[0].message.content
    assert [c.function.model_dump() for c in final.choices[0].message.tool_calls or []] == [
        c.function.model_dump() for c in answer.choices[0].message.tool_calls or []
    ]


def test_openai_agent_loop_on_the_demo(home) -> None:
    openai_loop(oai_of(home))


def test_openai_agent_loop_under_a_template_with_tools(native) -> None:
    openai_loop(oai_of(native))


@pytest.mark.parametrize(
    "prompt",
    ["Say hello to me.", "What's the weather like in Oslo today?", "Write one word."],
)
def test_auto_answers_are_text_or_whole_calls_streamed_alike(home, prompt: str) -> None:
    """On auto the model decides; whatever it does is well-formed, and the SDK's stream
    helper assembles the same answer (the call's index, id and name first, then its
    arguments; finish_reason tool_calls) as the non-streamed one."""
    client = oai_of(home)
    ask = dict(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        tools=[WEATHER],
        tool_choice="auto",
        max_tokens=48,
        temperature=0,
    )
    whole = client.chat.completions.create(**ask)
    well_formed(whole.choices[0])
    final = assembled(client, ask)
    assert final.choices[0].message.content == whole.choices[0].message.content
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason
    assert [c.function.model_dump() for c in final.choices[0].message.tool_calls or []] == [
        c.function.model_dump() for c in whole.choices[0].message.tool_calls or []
    ]


def test_streamed_call_deltas_are_in_the_sdk_order(home) -> None:
    chunks = list(
        oai_of(home).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Rome?"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=64,
            temperature=0,
            stream=True,
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    head, *rest = deltas
    assert head.index == 0 and head.id and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    jsonschema.validate(json.loads("".join(d.function.arguments for d in rest)), WEATHER_SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def anthropic_loop(client: anthropic.Anthropic) -> None:
    """tool_use (forced, `any`) -> tool_result -> the answer on auto; `messages.stream`
    and `get_final_message` assemble what the plain call returns."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = client.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=messages,
        tools=[ANTHROPIC_WEATHER],
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    with client.messages.stream(
        model=MODEL,
        max_tokens=64,
        messages=messages,
        tools=[ANTHROPIC_WEATHER],
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        (use.name, use.input)
    ]
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}],
        },
    ]
    answer = client.messages.create(
        model=MODEL, max_tokens=48, messages=messages, tools=[ANTHROPIC_WEATHER], extra_body=GREEDY
    )
    uses = [b for b in answer.content if b.type == "tool_use"]
    if answer.stop_reason == "tool_use":
        assert uses and all(b.name == "get_weather" for b in uses)
        for b in uses:
            jsonschema.validate(b.input, WEATHER_SCHEMA)
    else:
        assert not uses and answer.stop_reason in ("end_turn", "max_tokens")
        assert answer.content[0].type == "text"
    used = answer.usage
    total = used.input_tokens + used.cache_read_input_tokens + used.cache_creation_input_tokens
    assert total > first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_anthropic_agent_loop_on_the_demo(home) -> None:
    anthropic_loop(ant_of(home))


def test_anthropic_agent_loop_under_a_template_with_tools(native) -> None:
    anthropic_loop(ant_of(native))


def test_count_tokens_is_the_prompt_a_generation_has(home) -> None:
    """`messages.count_tokens` counts what `messages.create` then prefills (tools, system
    note and all); the same request again reads its prompt from the cache, which the
    usage fields say."""
    client = ant_of(home)
    ask = dict(
        model=MODEL,
        system="Be brief.",
        messages=[{"role": "user", "content": "Is it raining in Lima?"}],
        tools=[ANTHROPIC_WEATHER],
    )
    counted = client.messages.count_tokens(**ask).input_tokens
    bare = client.messages.count_tokens(model=MODEL, messages=ask["messages"]).input_tokens
    assert counted > bare > 0  # the tools are described in the prompt
    first = client.messages.create(max_tokens=4, extra_body=GREEDY, **ask).usage
    again = client.messages.create(max_tokens=4, extra_body=GREEDY, **ask).usage
    for used in (first, again):
        assert used.cache_creation_input_tokens == 0
        assert used.input_tokens + used.cache_read_input_tokens == counted
    assert again.cache_read_input_tokens > first.cache_read_input_tokens
    r = httpx.post(home.url + "/v1/messages/count_tokens", json={**ask, "max_tokens": 5})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "max_tokens" in r.json()["error"]["message"]


def test_langchain_bind_tools_invoke_and_stream(home) -> None:
    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return RESULT

    llm = ChatOpenAI(
        model=MODEL,
        base_url=home.url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=64,
        max_retries=0,
    )
    question = [HumanMessage("What's the weather in Paris?")]
    forced = llm.bind_tools([get_weather], tool_choice="get_weather")
    called = forced.invoke(question)
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    streamed = None
    for chunk in forced.stream(question):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]
    history = [
        *question,
        called,
        ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]),
    ]
    answer = llm.bind_tools([get_weather]).invoke(history)  # auto
    assert isinstance(answer, AIMessage)
    if answer.tool_calls:
        assert all(c["name"] == "get_weather" for c in answer.tool_calls)
        assert not answer.invalid_tool_calls
    else:
        assert isinstance(answer.content, str)


def test_the_demo_prompt_holds_the_call_and_its_result(demo_container: Path) -> None:
    """What the demo's template is given for the result turn (it cannot show tools): the
    tools and the call form in a system note, the call as call text in the assistant
    turn and the result in a user turn, all in the rendered prompt."""
    codec = TextCodec.load(demo_container)
    features = Features.of_template(
        codec.chat_templates, codec.generation_prompt(), codec.special_token_names()
    )
    assert not features.tools
    history = (
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "id": "call-1",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": RESULT},
    )
    plan = plan_tools(history, (WEATHER,), ToolChoice("auto"), features)
    assert plan.tools is None and plan.grammar is not None and plan.features.tools
    prompt = codec.render_chat(list(plan.messages), add_generation_prompt=True)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert "You can call these tools" in prompt and "get_weather" in prompt.split(call)[0]
    assert f"{call}<|im_end|>" in prompt
    assert f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response>" in prompt


@pytest.mark.parametrize(
    "path,body,words",
    [
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": ""}}]},
            "`tools` must be a list",
        ),
        (
            "/v1/messages",
            {"max_tokens": 8, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "server tools",
        ),
    ],
)
def test_bad_tools_are_one_line_400s(home, path: str, body: dict, words: str) -> None:
    r = httpx.post(
        home.url + path,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert words in message and "\n" not in message


def test_one_call_when_parallel_calls_are_off() -> None:
    """`parallel_tool_calls: false` (Anthropic `disable_parallel_tool_use`) keeps the
    first of the calls a model wrote; by default every call comes back."""
    from colibrid.http import anthropic as anthropic_api
    from colibrid.http import openai as openai_api
    from colibrid.serve.events import Done

    two = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    )
    done = Done("stop", 10, 20, 0, 0.1, 0.1, 100.0, 100.0)
    common = dict(served=MODEL, client=1, max_context=4096, features=Features())
    question = [{"role": "user", "content": "Weather in Oslo and Rome?"}]
    for parallel, count in ((None, 2), (True, 2), (False, 1)):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        body = {"model": MODEL, "messages": question, "tools": [WEATHER], **extra}
        stream = openai_api.ChatStream(openai_api.chat_plan(body, **common))
        stream.token(two)
        calls = stream.response(done)["choices"][0]["message"]["tool_calls"]
        assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == [
            "Oslo",
            "Rome",
        ][:count]
        choice = (
            {"type": "auto"}
            if parallel is None
            else {
                "type": "auto",
                "disable_parallel_tool_use": not parallel,
            }
        )
        body = {
            "model": MODEL,
            "max_tokens": 64,
            "messages": question,
            "tools": [ANTHROPIC_WEATHER],
            "tool_choice": choice,
        }
        message = anthropic_api.MessageStream(anthropic_api.messages_plan(body, **common))
        message.token(two)
        uses = [b for b in message.response(done)["content"] if b["type"] == "tool_use"]
        assert [b["input"]["city"] for b in uses] == ["Oslo", "Rome"][:count]
