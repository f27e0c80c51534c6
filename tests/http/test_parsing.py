"""The output splitter and tool-call parser on fixed strings (the tiny random model never
emits tags), fed whole and one character at a time, plus the translators' validation and
the grammars they make of forced tool calls and JSON answers (fed bytes, no model)."""

from __future__ import annotations

import numpy as np
import pytest
from structured_cases import byte_tokenizer_json

from colibrid.engine.constraint import Vocabulary
from colibrid.errors import ColibriError
from colibrid.http import anthropic, openai
from colibrid.http.errors import ApiError
from colibrid.http.parsing import (
    DEEPSEEK_CALL_TOKENS,
    HARMONY_CALL_TOKENS,
    Features,
    parse_tool_calls,
)
from colibrid.http.splitter import make_splitter, split_all
from colibrid.serve.events import Done

BOTH = Features(tools=True, think=True)
GLM = (
    "<think>the user wants weather</think>\n\nLet me check. <tool_call>get_weather"
    "<arg_key>city</arg_key><arg_value>Paris</arg_value>"
    "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
)


def by_char(text: str, features: Features):
    splitter = make_splitter(features)
    pieces = [p for ch in text for p in splitter.feed(ch)]
    rest, calls = splitter.finish()
    pieces += rest
    return (
        "".join(t for k, t in pieces if k == "reasoning"),
        "".join(t for k, t in pieces if k == "content"),
        calls,
    )


@pytest.mark.parametrize("split", [split_all, by_char])
def test_glm_reasoning_and_tool_call(split) -> None:
    reasoning, content, calls = split(GLM, BOTH)
    assert reasoning == "the user wants weather"
    assert content == "Let me check. "
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]
    assert calls[0].arguments_json == '{"city": "Paris", "days": 3}'


@pytest.mark.parametrize("split", [split_all, by_char])
def test_plain_text_and_near_tags_pass_through(split) -> None:
    text = "a < b and <thin> or <tool_cal but no tags"
    assert split(text, BOTH) == ("", text, [])
    assert split("<think>x</think>y", Features()) == ("", "<think>x</think>y", [])
    assert split("ends in <tool_ca", BOTH) == ("", "ends in <tool_ca", [])


def test_malformed_call_stays_text_and_json_calls_parse() -> None:
    assert split_all("x <tool_call><oops</tool_call>", BOTH)[1:] == (
        "x <tool_call><oops</tool_call>",
        [],
    )
    calls = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": {"a": [1]}}</tool_call>'
        "<tool_call>g<arg_key>q</arg_key><arg_value>hi there"
        "</arg_value>"
    )
    assert [(c.name, c.arguments) for c in calls] == [("f", {"a": [1]}), ("g", {"q": "hi there"})]


# DeepSeek-V3 (`function<sep>name` + fenced JSON) and V3.1 (`name<sep>` + JSON) calls
DEEPSEEK_V3 = (
    "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>'
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
    '```json\n{"tz": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
DEEPSEEK_V31 = (
    "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time'
    '<｜tool▁sep｜>{"tz": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)


@pytest.mark.parametrize("split", [split_all, by_char])
@pytest.mark.parametrize("text", [DEEPSEEK_V3, DEEPSEEK_V31], ids=["v3", "v3.1"])
def test_deepseek_tool_calls(split, text: str) -> None:
    reasoning, content, calls = split(text, BOTH)
    assert (reasoning, content) == ("", "Let me check.")
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_time", {"tz": "CET"}),
    ]


def test_deepseek_call_cut_short_or_malformed() -> None:
    cut = DEEPSEEK_V31[: DEEPSEEK_V31.index("<｜tool▁call▁begin｜>get_time")]
    assert [c.name for c in split_all(cut + "<｜tool▁call▁begin｜>get_ti", BOTH)[2]] == [
        "get_weather"
    ]
    bad = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>not json<｜tool▁call▁end｜>"
    assert split_all("x " + bad, BOTH) == ("", "x " + bad, [])
    # a grammar-forced call keeps the <tool_call> form on every family
    assert [c.name for c in split_all('<tool_call>{"name": "f", "arguments": {}}', BOTH)[2]] == [
        "f"
    ]


def test_features_from_template() -> None:
    assert Features.of_template("{% if tools %}{% endif %}<think>") == BOTH
    assert Features.of_template(None) == Features()
    # Qwen3 "Thinking-2507" / DeepSeek-V3.1 thinking: the generation prompt opens <think>
    opened = Features.of_template("{{ x }}", "<|im_start|>assistant\n<think>\n")
    assert opened == Features(think=True, think_open=True)
    closed = Features.of_template("<think>", "<|assistant|><think></think>")
    assert not closed.think_open and closed.think


@pytest.mark.parametrize("split", [split_all, by_char])
def test_a_prompt_that_opens_the_reasoning(split) -> None:
    """The answer has no `<think>`: everything before `</think>` is reasoning."""
    opened = Features(tools=True, think=True, think_open=True)
    text = "the user wants weather\n</think>\n\nLet me check. " + GLM.split("Let me check. ")[1]
    reasoning, content, calls = split(text, opened)
    assert (reasoning, content) == ("the user wants weather\n", "Let me check. ")
    assert [c.name for c in calls] == ["get_weather"]
    assert split("cut off while thinking", opened) == ("cut off while thinking", "", [])


def test_codec_generation_prompt(tmp_path, chat_model) -> None:
    """The codec renders the prompt the HTTP layer reads `think_open` from."""
    import json
    import shutil

    from colibrid.engine.tokenizer import TextCodec

    folder = tmp_path / "m"
    shutil.copytree(chat_model, folder)
    assert not Features.of_template("", TextCodec.load(folder).generation_prompt()).think_open
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    codec = TextCodec.load(folder)
    assert codec.generation_prompt() == "<|user|>Hi<|assistant|><think>\n"
    assert Features.of_template(codec.chat_templates, codec.generation_prompt()).think_open


COMMON = {"served": "m", "client": 1, "max_context": 256}
DONE = Done("stop", 5, 3, 0, 0.1, 0.1, 50.0, 30.0)


def test_chat_plan_messages_tools_and_errors() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": tools,
        "stop": "x",
        "max_tokens": 9,
        "seed": 3,
    }
    plan = openai.chat_plan(body, features=BOTH, **COMMON)
    msgs = plan.request.messages
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[3]["tool_call_id"] == "c1" and plan.request.tools == tuple(tools)
    assert plan.request.params.stop == ("x",) and plan.request.params.max_tokens == 9
    for bad, param in (
        ({"n": 9}, "n"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"temperature": 3}, "temperature"),
        ({"stop": 5}, "stop"),
    ):
        with pytest.raises(ApiError) as err:
            openai.chat_plan({**body, **bad}, features=BOTH, **COMMON)
        assert err.value.status == 400 and err.value.param == param
    # a template that cannot show tools: described in a system note, the earlier call as
    # call text, the result a user turn, and the answer held to text-or-a-call (http.tools)
    plain = openai.chat_plan(body, features=Features(), **COMMON)
    msgs = plain.request.messages
    assert plain.request.tools is None and plain.request.grammar is not None
    assert "get_weather" in msgs[0]["content"] and msgs[0]["content"].startswith("be brief")
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in msgs[2]["content"]
    )
    assert msgs[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def accepts(grammar, text: str) -> bool:  # noqa: ANN001
    """Whether `grammar` allows exactly `text` (fed byte by byte) and is complete after."""
    c = Vocabulary(byte_tokenizer_json(), 256, frozenset({0})).constraint(grammar.compile())
    try:
        for byte in text.encode():
            c.apply(np.zeros(256, dtype=np.float32))
            c.advance(byte)
    except ColibriError:
        return False
    return c.complete


def test_forced_calls_and_json_answers_become_one_grammar() -> None:
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    other = {"type": "function", "function": {"name": "other"}}
    hi = [{"role": "user", "content": "weather?"}]
    body = {"model": "m", "messages": hi, "tools": [weather, other], "tool_choice": "required"}
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    for features in (BOTH, Features()):  # the template shows tools, or a system note does
        plan = openai.chat_plan(body, features=features, **COMMON)
        grammar = plan.request.grammar
        assert grammar.kind == "tool_call" and plan.features.tools
        assert accepts(grammar, call) and accepts(grammar, call.replace("get_weather", "other"))
        assert not accepts(grammar, call.replace("Paris", 'Paris", "x": "y'))
        assert not accepts(grammar, "Sure! " + call) and not accepts(grammar, '{"city": "x"}')
        ((name, args),) = [(c.name, c.arguments) for c in parse_tool_calls(call)]
        assert (name, args) == ("get_weather", {"city": "Paris"})
        if features == BOTH:
            assert plan.request.tools == (weather, other) and plan.request.messages == tuple(hi)
        else:
            assert plan.request.tools is None
            note = plan.request.messages[0]
            assert note["role"] == "system" and '"name": "get_weather"' in note["content"]
    named = {**body, "tool_choice": {"type": "function", "function": {"name": "other"}}}
    grammar = openai.chat_plan(named, features=BOTH, **COMMON).request.grammar
    assert accepts(grammar, call.replace("get_weather", "other")) and not accepts(grammar, call)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    either = {**body, "tool_choice": "auto", "response_format": fmt}
    grammar = openai.chat_plan(either, features=BOTH, **COMMON).request.grammar
    assert accepts(grammar, '{"a": 1}') and accepts(grammar, call)
    assert not accepts(grammar, '{"a": "1"}') and not accepts(grammar, '{"a":1}')
    only = {"model": "m", "messages": hi, "response_format": fmt}
    grammar = openai.chat_plan(only, features=BOTH, **COMMON).request.grammar
    assert grammar.kind == "json_schema" and accepts(grammar, '{"a": 1}')
    assert not accepts(grammar, call)
    assert (
        openai.chat_plan(
            {**only, "response_format": {"type": "text"}}, features=BOTH, **COMMON
        ).request.grammar
        is None
    )
    free = {**body, "tool_choice": "auto"}
    assert openai.chat_plan(free, features=BOTH, **COMMON).request.grammar is None


def test_a_constrained_answer_cut_short_makes_no_call() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "w?"}], "tools": tools}
    for choice, length, calls in (("required", True, 0), ("required", False, 1), ("auto", True, 1)):
        plan = openai.chat_plan({**body, "tool_choice": choice}, features=BOTH, **COMMON)
        stream = openai.ChatStream(plan)
        stream.token('<tool_call>{"name": "f", "arguments": {}}')
        done = Done("length" if length else "stop", 5, 3, 0, 0.1, 0.1, 50.0, 30.0)
        out = stream.response(done)["choices"][0]
        assert len(out["message"].get("tool_calls") or []) == calls, (choice, length)
        assert out["finish_reason"] == ("tool_calls" if calls else "length")


def test_chat_response_with_tool_calls_and_reasoning() -> None:
    plan = openai.chat_plan(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "w?"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        features=BOTH,
        **COMMON,
    )
    stream = openai.ChatStream(plan)
    for ch in GLM:
        stream.token(ch)
    body = stream.response(DONE)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "the user wants weather"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_anthropic_plan_and_stream_events() -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "system": "sys",
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "w?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"c": 1}}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}],
            },
        ],
    }
    plan = anthropic.messages_plan(body, features=BOTH, **COMMON)
    roles = [m["role"] for m in plan.request.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    stream = anthropic.MessageStream(plan)
    names = [n for n, _ in stream.start(5)]
    names += [n for ch in GLM for n, _ in stream.token(ch)]
    names += [n for n, _ in stream.finish(DONE)]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert [b["type"] for b in stream.blocks] == ["thinking", "text", "tool_use"]
    assert stream.blocks[2]["input"] == {"city": "Paris", "days": 3}
    with pytest.raises(ApiError):
        anthropic.messages_plan({**body, "max_tokens": None}, features=BOTH, **COMMON)


HARMONY = Features(tools=True, think=True, harmony=True)
GPT_OSS = (
    "<|channel|>analysis<|message|>The user wants weather.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Let me check.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "days": 3}<|call|>'
)


@pytest.mark.parametrize("split", [split_all, by_char])
def test_harmony_channels_and_tool_call(split) -> None:
    """gpt-oss: analysis is the reasoning, final the answer, a message to=functions.X the
    call (recipient before or after the channel)."""
    reasoning, content, calls = split(GPT_OSS, HARMONY)
    assert reasoning == "The user wants weather."
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]
    before = "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>"
    assert split(before, HARMONY)[2][0].name == "f"


@pytest.mark.parametrize("split", [split_all, by_char])
def test_harmony_final_answer_and_plain_text(split) -> None:
    answer = (
        "<|channel|>analysis<|message|>think <|e<|end|>"
        "<|start|>assistant<|channel|>final<|message|>4 < 5"
    )
    assert split(answer + "<|return|>", HARMONY) == ("think <|e", "4 < 5", [])
    assert split(answer, HARMONY) == ("think <|e", "4 < 5", [])  # cut before <|return|>
    assert split("no channels here", HARMONY) == ("", "no channels here", [])
    forced = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'  # a grammar's call
    assert [(c.name, c.arguments) for c in split(forced, HARMONY)[2]] == [("f", {"a": 1})]
    # without tools the call is shown as text; a non-object body is no call
    bad = "<|channel|>commentary to=functions.f<|message|>[1]<|call|>"
    assert split(bad, HARMONY) == ("", "[1]", [])
    assert split(bad, Features(harmony=True)) == ("", "[1]", [])


def test_harmony_is_detected_from_the_template() -> None:
    assert Features.of_template("{{ '<|start|>assistant<|channel|>final<|message|>' }}").harmony
    assert not Features.of_template("<think>{{ m }}</think>").harmony


def test_harmony_reaches_both_translators_with_or_without_tools() -> None:
    """The plan keeps the template's Harmony flag when it sets `tools` from the request,
    so an OpenAI or Anthropic answer of gpt-oss is split by channels."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert openai.chat_plan(chat, features=HARMONY, **COMMON).features.harmony
    message = {**chat, "max_tokens": 9}
    plan = anthropic.messages_plan(message, features=HARMONY, **COMMON)
    assert plan.features.harmony and not plan.features.tools
    stream = openai.ChatStream(openai.chat_plan(chat, features=HARMONY, **COMMON))
    for ch in GPT_OSS[:-60]:  # cut inside the call's header, as max_tokens may
        stream.token(ch)
    reply = stream.response(DONE)["choices"][0]["message"]
    assert (
        reply["reasoning_content"] == "The user wants weather."
        and reply["content"] == "Let me check."
    )


DSML_FEATURES = Features(tools=True, think=True, call_syntax="dsml")
DEEPSEEK_V32 = (
    "Let me check.\n\n<｜DSML｜function_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris, "the" city</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="where" string="false">{"lat": 48.9, "tags": ["a"]}'
    "</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="get_time">\n'
    '<｜DSML｜parameter name="tz" string="true"> CET </｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜function_calls>"
)


@pytest.mark.parametrize("split", [split_all, by_char])
def test_deepseek_v32_dsml_tool_calls(split) -> None:
    """DeepSeek-V3.2: each invoke a call; a `string="true"` body is the text as it is, a
    `"false"` one is JSON."""
    reasoning, content, calls = split("<think>weather</think>" + DEEPSEEK_V32, DSML_FEATURES)
    assert (reasoning, content) == ("weather", "Let me check.\n\n")
    assert [(c.name, c.arguments) for c in calls] == [
        (
            "get_weather",
            {"city": 'Paris, "the" city', "days": 3, "where": {"lat": 48.9, "tags": ["a"]}},
        ),
        ("get_time", {"tz": " CET "}),
    ]
    # the markup is found whatever the template said (none of it occurs in plain text)
    assert [c.name for c in split(DEEPSEEK_V32, BOTH)[2]] == ["get_weather", "get_time"]


def test_dsml_cut_short_or_malformed() -> None:
    cut = DEEPSEEK_V32[: DEEPSEEK_V32.index('<｜DSML｜parameter name="days"') + 20]
    ((call,),) = [split_all(cut, DSML_FEATURES)[2]]
    assert (call.name, call.arguments) == ("get_weather", {"city": 'Paris, "the" city'})
    loose = (
        '<｜DSML｜function_calls><｜DSML｜invoke name="f">'
        '<｜DSML｜parameter name="n" string="false">not json</｜DSML｜parameter>'
    )
    assert [(c.name, c.arguments) for c in parse_tool_calls(loose)] == [("f", {"n": "not json"})]
    nameless = '<｜DSML｜function_calls><｜DSML｜invoke name=""></｜DSML｜invoke>'
    assert split_all("x " + nameless, DSML_FEATURES) == ("", "x " + nameless, [])
    dsml = Features.of_template("{{ '<｜DSML｜function_calls>' }}{% if tools %}{% endif %}")
    assert dsml.call_syntax == "dsml"
    assert Features.of_template("{% if tools %}<tool_call>{% endif %}").call_syntax == "json"


def test_a_forced_call_on_a_dsml_template_is_written_in_dsml() -> None:
    """DeepSeek-V3.2's template: a forced call is the model's own DSML block, each declared
    argument a parameter (plain strings as text, the rest JSON of their schema), optional
    ones optional; a schema DSML cannot state keeps the JSON form."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "where"},
                    "days": {"type": "integer", "minimum": 1},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
            },
        },
    }
    free = {"type": "function", "function": {"name": "note"}}
    nested = {
        "type": "function",
        "function": {"name": "pick", "parameters": {"anyOf": [{"type": "object"}]}},
    }
    hi = [{"role": "user", "content": "weather?"}]
    body = {
        "model": "m",
        "messages": hi,
        "tools": [weather, free, nested],
        "tool_choice": "required",
    }
    grammar = openai.chat_plan(body, features=DSML_FEATURES, **COMMON).request.grammar

    def dsml(name: str, *params: str) -> str:
        inner = "".join(p + "\n" for p in params)
        return (
            f'<｜DSML｜function_calls>\n<｜DSML｜invoke name="{name}">\n{inner}'
            "</｜DSML｜invoke>\n</｜DSML｜function_calls>"
        )

    city = '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>'
    days = '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>'
    unit = '<｜DSML｜parameter name="unit" string="false">"c"</｜DSML｜parameter>'
    call = dsml("get_weather", city, days, unit)
    assert accepts(grammar, call) and accepts(grammar, dsml("get_weather", city, unit))
    ((parsed,),) = [split_all(call, DSML_FEATURES)[2]]
    assert (parsed.name, parsed.arguments) == (
        "get_weather",
        {"city": "Paris", "days": 3, "unit": "c"},
    )
    assert not accepts(grammar, dsml("get_weather", city))  # a required one missing
    assert not accepts(grammar, dsml("get_weather", city, days.replace("3", "0"), unit))
    assert not accepts(grammar, dsml("get_weather", city, unit.replace('"c"', '"k"')))
    assert not accepts(grammar, dsml("get_weather", unit, city))  # declared order
    assert not accepts(grammar, dsml("get_weather", city.replace("Paris", "<b>"), unit))
    # any object: any named parameters, JSON values
    anything = '<｜DSML｜parameter name="text" string="false">"hi"</｜DSML｜parameter>'
    assert accepts(grammar, dsml("note")) and accepts(grammar, dsml("note", anything, anything))
    # a schema DSML cannot state exactly: the JSON form, held to the schema
    assert accepts(grammar, '<tool_call>{"name": "pick", "arguments": {}}</tool_call>')
    assert not accepts(grammar, '<tool_call>{"name": "pick", "arguments": []}</tool_call>')
    assert not accepts(grammar, '<tool_call>{"name": "note", "arguments": {}}</tool_call>')
    # other templates keep the JSON form for every tool
    grammar = openai.chat_plan(body, features=BOTH, **COMMON).request.grammar
    assert not accepts(grammar, call)
    assert accepts(grammar, '<tool_call>{"name": "note", "arguments": {}}</tool_call>')


HARMONY_TEMPLATE = "{% if tools %}{% endif %}<|start|>assistant<|channel|>final<|message|>"
V3_TEMPLATE = "{% if tools %}<｜tool▁calls▁begin｜>function<｜tool▁sep｜>```json{% endif %}"
V31_TEMPLATE = "{% if tools %}<｜tool▁calls▁begin｜>name<｜tool▁sep｜>{% endif %}"
SPECIALS = HARMONY_CALL_TOKENS | DEEPSEEK_CALL_TOKENS


def test_the_call_syntax_needs_the_template_and_for_special_tokens_the_tokenizer() -> None:
    def syntax(template: str, specials: frozenset[str] = SPECIALS) -> str:
        return Features.of_template(template, None, specials).call_syntax

    assert syntax(HARMONY_TEMPLATE) == "harmony"
    assert syntax(V3_TEMPLATE) == "deepseek_v3" and syntax(V31_TEMPLATE) == "deepseek_v31"
    # markers the tokenizer spells as text cannot be named by a grammar: the JSON form
    for template in (HARMONY_TEMPLATE, V3_TEMPLATE, V31_TEMPLATE):
        assert syntax(template, frozenset()) == "json"
    assert syntax("{% if tools %}<tool_call>{% endif %}") == "json"


def token_vocabulary() -> tuple[Vocabulary, dict[str, int]]:
    """The byte tokenizer plus the call syntaxes' special tokens (ids 256 and up)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(byte_tokenizer_json())
    names = sorted(SPECIALS)
    tok.add_special_tokens(names)
    ids = {name: tok.token_to_id(name) for name in names}
    return Vocabulary(tok.to_str(), tok.get_vocab_size(), frozenset({0})), ids


def accepts_tokens(grammar, pieces: list[str]) -> bool:  # noqa: ANN001
    """Whether `grammar` allows exactly `pieces` (a special token's name is that token,
    any other piece its bytes) and is complete after them."""
    vocab, ids = token_vocabulary()
    c = vocab.constraint(grammar.compile())
    tokens = [t for p in pieces for t in ([ids[p]] if p in ids else list(p.encode()))]
    try:
        for token in tokens:
            c.apply(np.zeros(vocab.vocab_size, dtype=np.float32))
            c.advance(token)
    except ColibriError:
        return False
    return c.complete


@pytest.mark.parametrize("syntax", ["harmony", "deepseek_v3", "deepseek_v31"])
def test_a_forced_call_is_written_in_the_templates_special_tokens(syntax: str) -> None:
    """gpt-oss and DeepSeek-V3/V3.1: the forced call is the model's own token sequence,
    its arguments held to the schema, and it parses back into the call."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [weather],
        "tool_choice": "required",
    }
    features = Features(tools=True, harmony=syntax == "harmony", call_syntax=syntax)
    grammar = openai.chat_plan(body, features=features, **COMMON).request.grammar
    args = '{"city": "Paris"}'
    pieces = {
        "harmony": [
            "<|channel|>",
            "commentary to=functions.get_weather ",
            "<|constrain|>",
            "json",
            "<|message|>",
            args,
        ],
        "deepseek_v3": [
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁call▁begin｜>",
            "function",
            "<｜tool▁sep｜>",
            "get_weather\n```json\n" + args + "\n```",
            "<｜tool▁call▁end｜>",
            "<｜tool▁calls▁end｜>",
        ],
        "deepseek_v31": [
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁call▁begin｜>",
            "get_weather",
            "<｜tool▁sep｜>",
            args,
            "<｜tool▁call▁end｜>",
            "<｜tool▁calls▁end｜>",
        ],
    }[syntax]
    assert accepts_tokens(grammar, pieces)
    assert not accepts_tokens(grammar, [p.replace("Paris", 'Paris", "x": "y') for p in pieces])
    assert not accepts_tokens(grammar, [p.replace("get_weather", "get_time") for p in pieces])
    # the markers as text are not the tokens
    assert not accepts_tokens(grammar, ["".join(pieces)])
    # and the text the engine decodes (special tokens kept) is the call
    _, content, calls = split_all("".join(pieces), features)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
