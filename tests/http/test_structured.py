"""Structured output through the real daemon serving the demo model: `response_format`
JSON schemas over HTTP (a subset of tests/engine/test_constraint.py's prompts, greedy and
sampled, concurrently), `tool_choice` required or named with the official openai client
(arguments valid for the tool's schema, streamed too), Anthropic's `any`, the openai
client's `parse()` with a pydantic model, answers cut by max_tokens, and bad schemas and
grammars refused before any token: HTTP 400 naming the field, SERVE BAD_REQUEST, and
`colibri ask` exiting 1 with the reason; `colibri ask -v` reports the mask cost."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from colibri_protocol.messages import Done, Submit
from daemon_helpers import Home, free_port, serving_http
from pydantic import BaseModel, Field
from structured_cases import SCHEMAS, closed, text

from colibri_cli.client import Client, ClientError
from colibrid.engine.tokenizer import TextCodec
from colibrid.http.parsing import Features

MODEL = "demo"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": closed({"city": text(24), "unit": {"enum": ["celsius", "fahrenheit"]}}),
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone",
        "parameters": closed({"zone": text(24)}),
    },
}
TOOLS = [WEATHER, TIME]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def home(demo_container: Path, tmp_path_factory):
    yield from serving_http(
        tmp_path_factory.mktemp("structured"),
        demo_container,
        max_active=4,
    )


@pytest.fixture(scope="module")
def oai(home):
    return openai.OpenAI(base_url=home.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def streamed_calls(chunks: list) -> list[tuple[str, str]]:
    """(name, arguments) per call, joined from the deltas as the SDKs do: the first
    delta of an index brings its name, the rest add argument text."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name, args = calls.setdefault(tc.index, ["", ""])
            calls[tc.index] = [
                name + (tc.function.name or ""),
                args + (tc.function.arguments or ""),
            ]
    return [(name, args) for _, (name, args) in sorted(calls.items())]


def ask(oai, prompt: str, **kw):  # noqa: ANN001
    return oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], **{"temperature": 0, **kw}
    )


def test_json_schema_answers_validate_greedy_and_sampled(oai) -> None:
    """Two prompts of each schema, greedy and sampled (seeded): 20 requests, 4 at once."""
    cases = [
        (name, schema, max_tokens, prompt, temperature)
        for name, (schema, max_tokens, prompts) in SCHEMAS.items()
        for prompt in prompts[:2]
        for temperature in (0.0, 0.8)
    ]

    def one(case):  # noqa: ANN001
        name, schema, max_tokens, prompt, temperature = case
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        return ask(
            oai, prompt, max_tokens=max_tokens, temperature=temperature, seed=7, response_format=fmt
        )

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, cases))
    for (name, schema, *_), answer in zip(cases, answers, strict=True):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
    r = ask(oai, "A cat, as JSON.", max_tokens=200, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a JSON object the model did not close within max_tokens: never a success
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_tool_choice_required_always_yields_a_valid_call(oai, temperature: float) -> None:
    prompts = [
        "What's the weather in Paris?",
        "Is it raining in Tokyo right now?",
        "What time is it in Berlin?",
        "Should I wear a coat in Oslo today?",
        "What time is it in New York?",
    ]
    for seed, prompt in enumerate(prompts):
        r = ask(
            oai,
            prompt,
            max_tokens=64,
            temperature=temperature,
            seed=seed,
            tools=TOOLS,
            tool_choice="required",
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_a_named_tool_is_the_one_called_streamed_or_not(oai) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    ask_it = dict(max_tokens=64, tools=TOOLS, tool_choice=named)
    r = ask(oai, "What's the weather in Paris?", **ask_it)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF["get_time"])
    chunks = list(ask(oai, "What's the weather in Paris?", stream=True, **ask_it))
    assert streamed_calls(chunks) == [(call.function.name, call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_anthropic_any_and_named_tool(home) -> None:
    client = anthropic.Anthropic(base_url=home.url, api_key="unused", max_retries=0)
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    for choice, name in (({"type": "any"}, None), ({"type": "tool", "name": "get_weather"}, 1)):
        m = client.messages.create(
            model=MODEL,
            max_tokens=64,
            messages=[{"role": "user", "content": "Weather in Rome?"}],
            tools=tools,
            tool_choice=choice,
            extra_body={"temperature": 0},
        )
        (block,) = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use"
        assert name is None or block.name == "get_weather"
        jsonschema.validate(block.input, SCHEMA_OF[block.name])


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=40)
    capital: bool


def test_the_openai_clients_parse_with_a_pydantic_model(oai) -> None:
    for prompt in ("Tell me about Paris.", "What do you know about Berlin?"):
        r = oai.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=64,
            temperature=0,
            response_format=City,
        )
        city = r.choices[0].message.parsed
        assert isinstance(city, City) and city.name and r.choices[0].finish_reason == "stop"


def test_cut_short_is_length_and_never_a_call(oai) -> None:
    schema = SCHEMAS["nested"][0]
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    r = ask(oai, "Tell me about Paris.", max_tokens=5, response_format=fmt)
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)
    r = ask(oai, "Weather in Paris?", max_tokens=8, tools=TOOLS, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith("<tool_call>")
    with pytest.raises(openai.LengthFinishReasonError):
        oai.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Paris?"}],
            max_tokens=4,
            response_format=City,
        )


@pytest.mark.parametrize(
    "extra,param,words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            "response_format",
            "invalid JSON schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": "x"}},
            "response_format",
            "json_schema",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
            "tools[0] parameters: invalid JSON schema",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope', which is not among",
        ),
        (  # on auto too: a call that starts is held to the schema (http.tools)
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools",
            "tools[0] parameters: invalid JSON schema",
        ),
        ({"tools": [{"type": "function", "function": {}}]}, "tools", "must be a list of"),
    ],
)
def test_bad_shapes_are_400_naming_the_field(home, extra, param, words) -> None:  # noqa: ANN001
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(home.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_serve_bad_grammars_are_bad_request_and_ask_reports_the_mask_cost(home, tmp_path) -> None:
    with Client.connect(home.socket, timeout_s=60) as client:
        for grammar, words in (
            ({"json_schema": {"type": "nope"}}, "invalid JSON schema: Invalid type: nope"),
            ({"lark": "start: foo"}, "invalid Lark grammar"),
            ({"regex": "a(b"}, "invalid regex"),
        ):
            with pytest.raises(ClientError) as err:
                list(client.generate(Submit(client.next_id(), prompt="hi", grammar=grammar)))
            assert err.value.code == "BAD_REQUEST" and words in str(err.value)
        events = list(
            client.generate(Submit("ok", prompt="Yes or no?", grammar={"regex": "yes|no"}))
        )
        done = events[-1]
        assert isinstance(done, Done) and done.finish == "stop"
        assert done.extras["grammar"] == "regex" and float(done.extras["mask_us"]) > 0
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMAS["object"][0]))
    r = home.colibri("ask", "-v", "--json-schema", str(schema), "Describe a pilot.")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), SCHEMAS["object"][0])
    assert "grammar json_schema:" in r.stderr and "µs a token" in r.stderr
    bad = tmp_path / "bad.lark"
    bad.write_text('start: "a" missing\n')
    r = home.colibri("ask", "--grammar", str(bad), "hi")
    assert r.returncode == 1 and "BAD_REQUEST: invalid Lark grammar" in r.stderr
    r = home.colibri("ask", "--regex", "(yes|no)", "Is Paris in France?")
    assert r.returncode == 0 and r.stdout.strip() in ("yes", "no")


# Each family's call syntax in a template the demo's weights can run: DeepSeek-V3.2's DSML is
# text; Harmony's and DeepSeek-V3's markers are special tokens, given to the demo's tokenizer
# by renaming some of its unused special tokens (same ids, so the weights still fit).
CALL_TEMPLATES = {
    "dsml": '<｜DSML｜function_calls><｜DSML｜invoke name="..."> with one <｜DSML｜parameter> '
    "per argument",
    "harmony": "<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}",
    "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n"
    "```json\n{...}\n```",
}
RENAMED = {  # an unused special token of the demo's tokenizer -> a call syntax's marker
    "<repo_name>": "<|channel|>",
    "<reponame>": "<|constrain|>",
    "<file_sep>": "<|message|>",
    "<filename>": "<｜tool▁calls▁begin｜>",
    "<gh_stars>": "<｜tool▁call▁begin｜>",
    "<issue_start>": "<｜tool▁sep｜>",
    "<issue_comment>": "<｜tool▁call▁end｜>",
    "<issue_closed>": "<｜tool▁calls▁end｜>",
}


def model_with_call_syntax(demo: Path, root: Path, syntax: str) -> Path:
    """The demo's files (hard links: a symlink out of the model folder is refused) with
    a chat template showing `syntax` and a tokenizer whose special tokens include its
    markers."""
    model = root / "models" / MODEL
    model.mkdir(parents=True)
    for f in demo.iterdir():
        if f.name != "tokenizer.json":
            os.link(f, model / f.name)
    tokenizer = json.loads((demo / "tokenizer.json").read_text())
    for added in tokenizer["added_tokens"]:
        if added["content"] in RENAMED:
            vocab = tokenizer["model"]["vocab"]
            vocab[RENAMED[added["content"]]] = vocab.pop(added["content"])
            added["content"] = RENAMED[added["content"]]
    (model / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (model / "chat_template.jinja").write_text(
        "{% if tools %}<|im_start|>system\nYou may call: {{ tools | tojson }}. A call is "
        + CALL_TEMPLATES[syntax]
        + ".<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return model


@pytest.mark.parametrize("syntax", list(CALL_TEMPLATES))
def test_a_forced_call_in_the_templates_own_syntax_comes_back_as_a_call(
    demo_container: Path, tmp_path, syntax: str
) -> None:
    """The real daemon on the demo weights under a template with DSML, Harmony or
    DeepSeek-V3/V3.1 calls: a required or named call is generated in that syntax (the
    grammar's), parsed back into OpenAI's tool_calls, streamed or not, with arguments
    valid for the tool's schema and no call text left in the content."""
    model = model_with_call_syntax(demo_container, tmp_path, syntax)
    codec = TextCodec.load(model)  # what the daemon reads: this syntax, not the JSON form
    features = Features.of_template(
        codec.chat_templates, codec.generation_prompt(), codec.special_token_names()
    )
    assert features.call_syntax == syntax
    port = free_port()
    h = Home(tmp_path / "home", model, http=f"127.0.0.1:{port}", shutdown_grace_s=1.0)
    h.start()
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )
        r = ask(
            client,
            "What's the weather in Paris?",
            max_tokens=200,
            tools=TOOLS,
            tool_choice="required",
        )
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message.content
        (call,) = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
        assert not r.choices[0].message.content
        named = {"type": "function", "function": {"name": "get_time"}}
        chunks = list(
            ask(
                client,
                "What time is it in Oslo?",
                max_tokens=200,
                stream=True,
                tools=TOOLS,
                tool_choice=named,
            )
        )
        streamed = streamed_calls(chunks)
        assert [name for name, _ in streamed] == ["get_time"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(streamed[0][1]), SCHEMA_OF["get_time"])
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ""
    finally:
        h.close()
