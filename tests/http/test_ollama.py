"""Ollama's native API against the real daemon with the official `ollama` Python client
(and httpx where the client has no call): chat and generate (streamed and not), the
final statistics, options (num_predict, num_ctx, penalties, seed), `format` schemas,
`think`, tools, list / show / ps / version, keep_alive load and unload, pull (an
unfetchable name's honest error), delete, and the one-line refusals."""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path

import httpx
import jsonschema
import ollama
import pytest
from daemon_helpers import GLM_TEMPLATE, serving_http

from colibrid.http import ollama as translator
from colibrid.http.openai import Plan
from colibrid.http.parsing import Features
from colibrid.serve.events import Done, Token
from colibrid.serve.requests import GenerateRequest

MODEL = "model"  # the chat_model fixture's folder name
HI = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "repeat_penalty": 1.0}


@pytest.fixture(scope="module")
def home(chat_model: Path, tmp_path_factory):
    path = tmp_path_factory.mktemp("h")
    (path / "models").mkdir()
    (path / "models" / MODEL).symlink_to(chat_model, target_is_directory=True)  # by name
    yield from serving_http(
        path,
        path / "models" / MODEL,
        max_queue=32,
        max_active=4,
        profile_save_s=30.0,
    )


@pytest.fixture(scope="module")
def client(home) -> ollama.Client:
    return ollama.Client(host=home.url, timeout=120)


def chat(client, **kw):
    options = {**GREEDY, "num_predict": 8, **kw.pop("options", {})}
    return client.chat(model=MODEL, messages=kw.pop("messages", HI), options=options, **kw)


def refused(call, status: int = 400) -> str:
    """The error of a refused call: its status, and one line."""
    with pytest.raises(ollama.ResponseError) as info:
        result = call()
        if not isinstance(result, (ollama.ChatResponse, ollama.GenerateResponse)):
            list(result)  # a stream raises as it is read
    assert info.value.status_code == status
    assert info.value.error and "\n" not in info.value.error
    return info.value.error


def test_chat_streaming_equals_non_streaming(client) -> None:
    whole = chat(client)
    assert whole.done and whole.done_reason == "length"
    assert whole.eval_count == 8 and whole.prompt_eval_count > 0
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.total_duration >= whole.eval_duration > 0
    assert whole.prompt_eval_duration > 0 and whole.load_duration >= 0
    parts = list(chat(client, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 8
    assert "".join(p.message.content for p in parts) == whole.message.content


def test_ndjson_framing_is_ollamas_default(home) -> None:
    body = {"model": MODEL, "messages": HI, "options": {**GREEDY, "num_predict": 3}}
    with httpx.stream("POST", home.url + "/api/chat", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert len(lines) >= 2 and lines[-1]["done"] is True
    assert {"model", "created_at", "message", "done"} <= set(lines[0])
    created = datetime.fromisoformat(lines[0]["created_at"].replace("Z", "+00:00"))
    assert abs((datetime.now(timezone.utc) - created).total_seconds()) < 60


def test_greedy_chat_equals_the_openai_endpoint(home, client) -> None:
    ours = chat(client, options={"num_predict": 12}).message.content
    r = httpx.post(
        home.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": HI, "max_tokens": 12, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200
    assert ours == r.json()["choices"][0]["message"]["content"]


def test_generate_templated_raw_and_streamed(home, client) -> None:
    templated = client.generate(
        model=MODEL, prompt=HI[0]["content"], options={**GREEDY, "num_predict": 8}
    )
    assert templated.response == chat(client).message.content  # the prompt as a user turn
    raw = client.generate(
        model=MODEL, prompt="Paris is", raw=True, options={**GREEDY, "num_predict": 6}
    )
    r = httpx.post(
        home.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Paris is", "max_tokens": 6, "temperature": 0},
        timeout=60,
    )
    assert raw.response == r.json()["choices"][0]["text"]
    streamed = list(
        client.generate(
            model=MODEL,
            prompt="Paris is",
            raw=True,
            stream=True,
            options={**GREEDY, "num_predict": 6},
        )
    )
    assert "".join(p.response for p in streamed) == raw.response
    assert streamed[-1].done and streamed[-1].context is None  # no context ids (documented)


def test_options_take_effect(client) -> None:
    assert chat(client, options={"num_predict": 3}).eval_count == 3
    plain = chat(client, options={"num_predict": 24}).message.content
    penalised = chat(client, options={"num_predict": 24, "repeat_penalty": 3.0}).message.content
    assert penalised != plain
    # Ollama's default repeat_penalty (1.1) applies when the option is left out
    default = client.chat(
        model=MODEL, messages=HI, options={"temperature": 0, "num_predict": 24}
    ).message.content
    explicit = chat(client, options={"num_predict": 24, "repeat_penalty": 1.1}).message.content
    assert default == explicit
    seeded = {"temperature": 1.0, "seed": 1234, "num_predict": 10}
    assert (
        chat(client, options=seeded).message.content == chat(client, options=seeded).message.content
    )
    cut = plain[len(plain) // 2 :][:2]
    stopped = chat(client, options={"num_predict": 24, "stop": [cut]})
    assert stopped.done_reason == "stop" and stopped.message.content == plain[: plain.index(cut)]


def test_logprobs(home, client) -> None:
    r = chat(client, logprobs=True, top_logprobs=2, options={"num_predict": 4})
    assert len(r.logprobs) == r.eval_count == 4
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in r.logprobs)
    # greedy: each chosen token is the likeliest of its alternatives
    assert all(lp.logprob == lp.top_logprobs[0].logprob for lp in r.logprobs)
    # each token's bytes (a token may hold part of a character) make up the answer
    raw = httpx.post(
        home.url + "/api/chat",
        json={
            "model": MODEL,
            "messages": HI,
            "stream": False,
            "logprobs": True,
            "options": {**GREEDY, "num_predict": 4},
        },
        timeout=60,
    ).json()
    text = b"".join(bytes(lp["bytes"]) for lp in raw["logprobs"])
    assert text.decode("utf-8", errors="replace") == raw["message"]["content"]


def test_num_ctx_bounds_prompt_and_answer(client) -> None:
    prompt = chat(client, options={"num_predict": 1}).prompt_eval_count
    fitted = chat(client, options={"num_predict": 50, "num_ctx": prompt + 3})
    assert fitted.eval_count == 3 and fitted.done_reason == "length"
    assert "num_ctx" in refused(lambda: chat(client, options={"num_ctx": prompt}))
    assert "num_ctx" in refused(lambda: chat(client, options={"num_ctx": 10**7}))


def test_format_schema(client) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = chat(client, format=schema, options={"num_predict": 60})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), schema)
    # "json": any object (the tiny model's strings run long: a whole one is not awaited)
    any_json = chat(client, format="json", options={"num_predict": 8})
    assert any_json.message.content.startswith("{")
    assert "format" in refused(lambda: chat(client, format={"type": 12}))


def test_think(client) -> None:
    # the tiny template has a <think> block: reasoning, when written, comes in `thinking`
    r = chat(client, think=True)
    assert r.done and r.message.content is not None
    assert "think" in refused(lambda: chat(client, think=False))
    assert "levels" in refused(lambda: chat(client, think="high"))


# A compact template that renders tools, calls and results itself (the tiny model's context
# is 256 tokens: http.tools' note for a template without tools would not fit in it).
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>{% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% for c in m.tool_calls or [] %}"
    "<tool_call>{{ c.function.name }}{{ c.function.arguments | tojson }}</tool_call>"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_tools_and_tool_turns(home, client, chat_model: Path) -> None:
    folder = home.path / "models" / "tooly"
    shutil.copytree(chat_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": TOOLS_TEMPLATE})
    )
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    call = {"function": {"name": "weather", "arguments": {"city": "Paris"}}}
    turns = [
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sun", "tool_name": "weather"},
    ]
    try:
        ask = {"model": "tooly", "messages": turns, "options": {**GREEDY, "num_predict": 4}}
        shown = client.chat(**ask, tools=[tool])
        plain = client.chat(**ask)
        assert shown.done and plain.done
        # the template listed the tool: the same turns, a longer prompt
        assert shown.prompt_eval_count > plain.prompt_eval_count
        assert shown.message.tool_calls is None or all(
            isinstance(c.function.arguments, dict) for c in shown.message.tool_calls
        )
        bad = [{"type": "function", "function": {"description": "no name"}}]
        assert "tools" in refused(lambda: client.chat(**ask, tools=bad))
    finally:  # the loaded model goes: unloaded first, then its folder
        assert client.delete("tooly").status == "success"
    assert not folder.exists() and client.ps().models == []


def test_tool_calls_come_back_as_objects() -> None:
    """The translator (pure) reads a call out of the answer as Ollama shows it: arguments
    an object, streamed as a message of their own before the final line."""
    plan = Plan(
        GenerateRequest(
            id="t", client=0, params=translator.sampling({}, max_context=64, logprobs=None)
        ),
        MODEL,
        stream=True,
        features=Features(tools=True),
    )
    exchange = translator.Exchange(plan, chat=True, num_ctx=None, logprobs=False)
    stream = translator.Stream(exchange, started_ns=0, load_ns=0)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    lines = [*stream.token(Token("Let me look. ")), *stream.token(Token(call))]
    done = Done("stop", 5, 20, 0, 0.1, 0.2, 50.0, 100.0)
    lines += stream.finish(done)
    assert "".join(line["message"]["content"] for line in lines) == "Let me look. "
    calls = [c for line in lines for c in line["message"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert calls[0]["function"]["arguments"] == {"city": "Paris"}
    assert lines[-1]["done"] and lines[-1]["eval_count"] == 20
    assert lines[-1]["eval_duration"] == 200_000_000


def test_list_show_version(home, client, chat_model: Path) -> None:
    listed = client.list().models
    assert [m.model for m in listed] == [MODEL]
    entry = listed[0]
    assert entry.size > 0 and len(entry.digest) == 64
    assert entry.details.family == "glm4_moe" and entry.details.format == "safetensors"
    shown = client.show(MODEL)
    config = json.loads((chat_model / "config.json").read_text())
    assert shown.modelinfo["general.architecture"] == "glm4_moe"
    assert shown.modelinfo["glm4_moe.block_count"] == config["num_hidden_layers"]
    assert shown.modelinfo["glm4_moe.embedding_length"] == config["hidden_size"]
    assert shown.modelinfo["glm4_moe.expert_count"] == config["n_routed_experts"]
    assert shown.template == GLM_TEMPLATE
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities)
    assert "temperature 0.8" in shown.parameters
    assert client.show(MODEL + ":latest").template == GLM_TEMPLATE
    assert refused(lambda: client.show("nope"), 404)
    version = httpx.get(home.url + "/api/version", timeout=10).json()["version"]
    status = json.loads(home.colibri("ps", "--json").stdout or "{}")
    assert version and version == status.get("version", version)


def test_refusals_are_one_line(home, client) -> None:
    assert "images" in refused(lambda: chat(client, messages=[{**HI[0], "images": ["aGk="]}]))
    assert "num_gpu" in refused(lambda: chat(client, options={"num_gpu": 1}))
    assert "mirostat" in refused(lambda: chat(client, options={"mirostat": 2}))
    chat(client, options={"mirostat": 0, "typical_p": 1.0})  # "off" is what is done
    assert "context" in refused(lambda: client.generate(model=MODEL, prompt="hi", context=[1, 2]))
    assert "suffix" in refused(lambda: client.generate(model=MODEL, prompt="def", suffix="x"))
    assert "embeddings" in refused(lambda: client.embed(model=MODEL, input="hi"), 501)
    assert "embeddings" in refused(lambda: client.embeddings(model=MODEL, prompt="hi"), 501)
    r = httpx.post(home.url + "/api/chat", json={"model": MODEL, "messages": HI, "bogus": 1})
    assert r.status_code == 400 and r.json() == {"error": "`bogus` is not a field of /api/chat"}
    assert httpx.get(home.url + "/api/nothing").json()["error"].startswith("no route")


def test_pull_an_unfetchable_name_says_why(client) -> None:
    error = refused(lambda: client.pull("llama3.2"))
    assert "cannot fetch 'llama3.2'" in error and "registry" in error
    assert "cannot fetch" in refused(lambda: client.pull("/etc", stream=True))


@pytest.mark.slow
def test_pull_builds_the_demo_with_progress(client, demo_gguf: Path) -> None:
    # the daemon's child finds the GGUF the fixture fetched (same cache): no download
    statuses = [line.status for line in client.pull("demo", stream=True)]
    assert statuses[-1] == "success" and any("upcycling" in s for s in statuses)
    assert any(s.startswith("demo: installed at") for s in statuses)
    assert "demo" in [m.model for m in client.list().models]
    assert client.pull("demo:latest").status == "success"  # there already: says so
    assert client.delete("demo").status == "success"


def test_delete(home, client, chat_model: Path) -> None:
    models = home.path / "models"
    models.mkdir(exist_ok=True)
    (models / "extra").symlink_to(chat_model, target_is_directory=True)
    assert "extra" in [m.model for m in client.list().models]
    assert client.delete("extra").status == "success"
    assert not (models / "extra").exists() and chat_model.is_dir()  # a link: its folder stays
    assert "extra" not in [m.model for m in client.list().models]
    assert refused(lambda: client.delete("extra"), 404)


def test_keep_alive_loads_and_unloads(client) -> None:
    chat(client)
    ps = client.ps().models
    assert [m.model for m in ps] == [MODEL] and ps[0].size > 0 and ps[0].context_length > 0
    assert ps[0].expires_at > datetime.now(timezone.utc)
    gone = client.generate(model=MODEL, keep_alive=0)
    assert gone.done and gone.done_reason == "unload"
    assert client.ps().models == []
    back = client.chat(model=MODEL, messages=[], keep_alive="10m")
    assert back.done_reason == "load" and back.load_duration > 0
    (loaded,) = client.ps().models
    left = (loaded.expires_at - datetime.now(timezone.utc)).total_seconds()
    assert 500 < left <= 600
    assert chat(client).done  # answers again
