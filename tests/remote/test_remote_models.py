"""Remote models behind the daemon (issue 43, part 3): `colibri pull URL --name team`, then
every front end of a first daemon answers `team` from a second, real colibrid serving the
demo over its OpenAI-compatible HTTP API with an API key.

Nothing is mocked: two daemons, the real CLI, the official openai / anthropic / ollama
clients. Each answer through the first daemon is compared with the second daemon's own
answer to the same request (greedy), which is what a remote model must give.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import stat
import sys
from datetime import datetime
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from colibri_protocol.codec import encode_line
from colibri_protocol.messages import Data, Done, Submit, encode_submit
from daemon_helpers import Home, free_port, wait_for
from tmux_helpers import Tmux

from colibri_cli.client import Client
from colibrid.remote.spec import write_spec

KEY = "upstream-s3cret-7f1c"  # the second daemon's API key: must never show on the first
QUESTION = "What is the capital of France?"
Q = [{"role": "user", "content": QUESTION}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory, demo_container: Path):
    """The remote: a colibrid serving the demo over HTTP, keyed."""
    path = tmp_path_factory.mktemp("upstream")
    (path / "api.key").write_text(KEY + "\n")
    (path / "api.key").chmod(0o600)
    port = free_port()
    home = Home(
        path,
        demo_container,
        http=f"127.0.0.1:{port}",
        http_api_key_file="api.key",
        shutdown_grace_s=1.0,
    )
    home.env["COLIBRI_NO_PULL"] = "1"
    home.start()
    home.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    try:
        yield home
    finally:
        home.close()


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory, demo_container: Path, upstream: Home):
    """The daemon users talk to: its own local model, and `team` pulled from `upstream`."""
    path = tmp_path_factory.mktemp("front")
    port = free_port()
    home = Home(path, demo_container, http=f"127.0.0.1:{port}", shutdown_grace_s=1.0)
    home.env["COLIBRI_NO_PULL"] = "1"
    home.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    pulled = home.colibri("pull", upstream.url, "--name", "team")  # type: ignore[attr-defined]
    assert pulled.returncode == 1 and "refused a request without a key (401" in pulled.stderr
    home.env["UPSTREAM_KEY"] = KEY
    pulled = home.colibri(
        "pull",
        upstream.url + "/v1",  # type: ignore[attr-defined]
        "--name",
        "team",
        "--api-key-env",
        "UPSTREAM_KEY",
    )
    del home.env["UPSTREAM_KEY"]
    assert pulled.returncode == 0, pulled.stderr
    assert "team: remote model demo at " + upstream.url in pulled.stdout  # type: ignore[attr-defined]
    assert KEY not in pulled.stdout + pulled.stderr
    home.start()
    try:
        yield home
    finally:
        home.close()


def upstream_openai(upstream: Home) -> openai.OpenAI:
    return openai.OpenAI(base_url=upstream.url + "/v1", api_key=KEY)  # type: ignore[attr-defined]


def front_openai(front: Home) -> openai.OpenAI:
    return openai.OpenAI(base_url=front.url + "/v1", api_key="unused")  # type: ignore[attr-defined]


# ---- installing and listing ---------------------------------------------------------------
def test_pull_installs_the_endpoint_and_list_shows_it_remote(front: Home, upstream: Home) -> None:
    spec = json.loads((front.path / "models" / "team" / "remote.json").read_text())
    assert spec == {"url": upstream.url, "model": "demo"}  # type: ignore[attr-defined]
    key_file = front.path / "keys" / "team"
    assert key_file.read_text().strip() == KEY
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    listed = front.colibri("list")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith("team "))
    assert "remote" in row and f"demo at {upstream.url}" in row  # type: ignore[attr-defined]
    rows = [json.loads(line) for line in front.colibri("list", "--json").stdout.splitlines()]
    team = next(r for r in rows if r["name"] == "team")
    assert team["arch"] == "remote"
    assert team["quantisation"] == ""  # the server's own: unknown here, not a URL
    assert team["remote"] == {"url": upstream.url, "model": "demo"}  # type: ignore[attr-defined]
    models = [m.id for m in front_openai(front).models.list()]
    assert "team" in models and "demo" in models


def test_pull_refuses_what_it_cannot_install(front: Home) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    for args, needle in (
        ((dead, "--name", "nothing"), f"cannot reach {dead}"),
        (("ftp://example.org", "--name", "x"), "only an http:// or https:// server"),
        (("http://user:pw@127.0.0.1:1", "--name", "x"), "carries credentials"),
        ((dead, "--name", "x", "--api-key-env", "NOT_SET_ANYWHERE"), "not set or empty"),
        (("demo", "--api-key-env", "X"), "are for `colibri pull URL`"),
    ):
        result = front.colibri("pull", *args)
        assert result.returncode == 1
        error = [line for line in result.stderr.splitlines() if "error" in line]
        assert len(error) == 1 and needle in error[0], result.stderr
        assert "Traceback" not in result.stderr


# ---- the same text through every front end --------------------------------------------------
def test_ask_and_run_through_the_daemon_equal_the_remote_answer(
    front: Home, upstream: Home
) -> None:
    own = upstream.colibri("ask", "--max-tokens", "24", QUESTION)
    assert own.returncode == 0, own.stderr
    assert own.stdout.strip()
    through = front.colibri("ask", "--model", "team", "--max-tokens", "24", QUESTION)
    assert through.returncode == 0, through.stderr
    assert through.stdout == own.stdout
    ran = front.colibri("run", "--max-tokens", "24", "team", QUESTION)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == own.stdout
    status = json.loads(front.colibri("ps", "--json").stdout)
    assert status["model"] == "demo"  # the local model stayed loaded
    assert status["remote"]["team"]["requests_done"] >= 2


def test_openai_anthropic_and_ollama_equal_the_remote_answer(front: Home, upstream: Home) -> None:
    ask = {"messages": Q, "temperature": 0, "max_tokens": 24}
    own = upstream_openai(upstream).chat.completions.create(model="demo", **ask)
    text = own.choices[0].message.content
    assert text
    ours = front_openai(front)
    answer = ours.chat.completions.create(model="team", **ask)
    assert answer.choices[0].message.content == text
    assert answer.usage.completion_tokens == own.usage.completion_tokens
    chunks = ours.chat.completions.create(model="team", stream=True, **ask)
    streamed = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(streamed) == text and len([s for s in streamed if s]) > 1
    own_text = upstream_openai(upstream).completions.create(
        model="demo", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    completion = ours.completions.create(
        model="team", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert completion.choices[0].text == own_text.choices[0].text
    claude = anthropic.Anthropic(base_url=front.url, api_key="unused")  # type: ignore[attr-defined]
    message = claude.messages.create(
        model="team", max_tokens=24, messages=Q, extra_body={"temperature": 0}
    )
    assert message.content[0].text == text
    with claude.messages.stream(
        model="team", max_tokens=24, messages=Q, extra_body={"temperature": 0}
    ) as stream:
        assert "".join(stream.text_stream) == text
    options = {"temperature": 0, "num_predict": 24}
    own_chat = ollama.Client(
        host=upstream.url,  # type: ignore[attr-defined]
        headers={"authorization": f"Bearer {KEY}"},
    ).chat(model="demo", messages=Q, options=options)
    local = ollama.Client(host=front.url)  # type: ignore[attr-defined]
    assert local.chat(model="team", messages=Q, options=options).message.content == (
        own_chat.message.content
    )
    parts = local.chat(model="team", messages=Q, options=options, stream=True)
    assert "".join(p.message.content for p in parts) == own_chat.message.content
    generated = local.generate(model="team", prompt=QUESTION, options=options)
    assert generated.response == own_chat.message.content  # the same chat, by /api/generate


def test_structured_output_and_tools_pass_through(
    front: Home, upstream: Home, tmp_path: Path
) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string"}},
        "required": ["capital"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    ask = {"messages": Q, "temperature": 0, "max_tokens": 40, "response_format": fmt}
    own = upstream_openai(upstream).chat.completions.create(model="demo", **ask)
    ours = front_openai(front).chat.completions.create(model="team", **ask)
    assert ours.choices[0].message.content == own.choices[0].message.content
    assert "capital" in json.loads(ours.choices[0].message.content)
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    ask = {"messages": weather, "temperature": 0, "max_tokens": 120, "tools": TOOLS}
    own = upstream_openai(upstream).chat.completions.create(
        model="demo", tool_choice="required", **ask
    )
    ours = front_openai(front).chat.completions.create(model="team", tool_choice="required", **ask)
    assert ours.choices[0].finish_reason == "tool_calls"
    mine, theirs = ours.choices[0].message.tool_calls, own.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in mine] == [
        (c.function.name, json.loads(c.function.arguments)) for c in theirs
    ]
    # SERVE's JSON schema goes as response_format; a Lark grammar has no OpenAI field
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    by_schema = front.colibri("ask", "--model", "team", "--json-schema", str(schema_file), QUESTION)
    assert by_schema.returncode == 0, by_schema.stderr
    assert "capital" in json.loads(by_schema.stdout)
    lark_file = tmp_path / "answer.lark"
    lark_file.write_text('start: "Paris"\n')
    for flag, value, form in (("--grammar", str(lark_file), "lark"), ("--regex", "Paris", "regex")):
        refused = front.colibri("ask", "--model", "team", flag, value, QUESTION)
        assert refused.returncode == 1
        assert refused.stderr.strip().count("\n") == 0
        assert f"a {form} grammar cannot be sent to a remote model" in refused.stderr
    with pytest.raises(openai.BadRequestError, match="logprobs: not available"):
        front_openai(front).chat.completions.create(model="team", messages=Q, logprobs=True)


def test_the_stop_string_that_ended_a_remote_answer_is_named(front: Home, upstream: Home) -> None:
    """The endpoint says which stop string ended its answer (vLLM's `stop_reason`, which
    colibrid's OpenAI API writes too): Anthropic's `stop_sequence` names it, as the
    remote's own Anthropic answer does, and so does the OpenAI choice."""
    whole = upstream_openai(upstream).chat.completions.create(
        model="demo", messages=Q, temperature=0, max_tokens=24
    )
    text = whole.choices[0].message.content
    cut = text[len(text) // 2 :][:2]
    assert cut.strip()
    stops = ["never appears", cut]
    own = anthropic.Anthropic(base_url=upstream.url, api_key=KEY).messages.create(  # type: ignore[attr-defined]
        model="demo", max_tokens=24, messages=Q, stop_sequences=stops, extra_body={"temperature": 0}
    )
    assert own.stop_reason == "stop_sequence" and own.stop_sequence == cut
    claude = anthropic.Anthropic(base_url=front.url, api_key="unused")  # type: ignore[attr-defined]
    ask = dict(model="team", max_tokens=24, messages=Q, stop_sequences=stops)
    for streamed in (False, True):
        if streamed:
            with claude.messages.stream(**ask, extra_body={"temperature": 0}) as stream:
                message = stream.get_final_message()
        else:
            message = claude.messages.create(**ask, extra_body={"temperature": 0})
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", cut)
        assert message.content[0].text == own.content[0].text == text[: text.index(cut)]
    # no stop string asked: no stop sequence named
    plain = claude.messages.create(
        model="team", max_tokens=24, messages=Q, extra_body={"temperature": 0}
    )
    assert plain.stop_reason != "stop_sequence" and plain.stop_sequence is None
    answer = front_openai(front).chat.completions.create(
        model="team", messages=Q, temperature=0, max_tokens=24, stop=stops
    )
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].model_extra["stop_reason"] == cut


def test_ollama_show_and_tags_give_a_remote_model_its_digest_and_time(front: Home) -> None:
    remote_json = front.path / "models" / "team" / "remote.json"
    digest = hashlib.sha256(remote_json.read_bytes()).hexdigest()
    mtime = remote_json.stat().st_mtime
    local = ollama.Client(host=front.url)  # type: ignore[attr-defined]
    tagged = next(m for m in local.list().models if m.model == "team")
    assert tagged.digest == digest
    assert abs(tagged.modified_at.timestamp() - mtime) < 1.0
    assert tagged.details.format == "remote"
    shown = local.show("team")
    assert abs(shown.modified_at.timestamp() - mtime) < 1.0
    assert shown.modified_at > datetime.fromisoformat("2001-01-01T00:00:00+00:00")
    url = json.loads(remote_json.read_text())["url"]
    assert f"FROM {url}" in shown.modelfile
    # pulled again elsewhere (another name for the same server here): another identity
    demo = next(m for m in local.list().models if m.model == "demo")
    assert demo.digest != digest and demo.details.format == "safetensors"


def test_rm_of_a_remote_model_takes_its_key_file_with_it(front: Home, upstream: Home) -> None:
    """`colibri rm` and Ollama's DELETE /api/delete remove the key pull stored, and say
    so: a later model of the name is never sent it."""
    front.env["UPSTREAM_KEY"] = KEY
    try:
        for name in ("spare", "spare2"):
            pulled = front.colibri(
                "pull",
                upstream.url,
                "--name",
                name,
                "--api-key-env",
                "UPSTREAM_KEY",  # type: ignore[attr-defined]
            )
            assert pulled.returncode == 0, pulled.stderr
            assert (front.path / "keys" / name).read_text().strip() == KEY
    finally:
        del front.env["UPSTREAM_KEY"]
    assert front.colibri("ask", "--model", "spare", "--max-tokens", "2", QUESTION).returncode == 0
    removed = front.colibri("rm", "spare")
    assert removed.returncode == 0, removed.stderr
    key_file = front.path / "keys" / "spare"
    said = removed.stdout.strip()
    assert said.startswith("removed spare (a remote model; its key file "), said
    assert said.endswith("/keys/spare deleted)"), said
    assert not key_file.exists() and not (front.path / "models" / "spare").exists()
    assert not [p for p in (front.path / "models").iterdir() if ".removing-" in p.name]
    ollama.Client(host=front.url).delete("spare2")  # type: ignore[attr-defined]
    assert not (front.path / "keys" / "spare2").exists()
    assert not (front.path / "models" / "spare2").exists()
    assert (front.path / "keys" / "team").is_file()  # the others' keys stay
    # a remote model pulled without a key: nothing else to remove, and it says so
    write_spec(front.path / "models" / "keyfree", upstream.url, "demo")  # type: ignore[attr-defined]
    removed = front.colibri("rm", "keyfree")
    assert removed.returncode == 0 and removed.stdout.strip() == "removed keyfree (a remote model)"


# ---- cancellation, failures, and the key ----------------------------------------------------
def test_a_client_that_leaves_ends_the_upstream_request(front: Home, upstream: Home) -> None:
    body = {
        "model": "team",
        "messages": [{"role": "user", "content": "Count from 1 to 400, one number a line."}],
        "max_tokens": 800,
        "temperature": 0,
        "stream": True,
    }
    url = front.url + "/v1/chat/completions"  # type: ignore[attr-defined]
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data:")
            if seen == 4:
                break
    # the upstream daemon logs the request it answered as cancelled: the connection closed
    assert wait_for(lambda: "failed CANCELLED" in upstream.log(), timeout_s=20), upstream.log()
    assert wait_for(lambda: "remote team" in front.log() and "CANCELLED" in front.log())


def test_a_serve_stop_keeps_the_answer_so_far(front: Home) -> None:
    ask = "Count from 1 to 400, one number a line."
    with Client.connect(front.socket, timeout_s=60) as client:
        messages = ({"role": "user", "content": ask},)
        submit = Submit("s1", messages=messages, max_tokens=800, model="team")
        client.send(encode_submit(submit))
        texts, done = [], None
        for item in client.follow("s1"):
            if isinstance(item, Data):
                texts.append(item.text)
                if len(texts) == 3:
                    client.send(encode_line("STOP", "s1"))
            elif isinstance(item, Done):
                done = item
    assert done is not None and done.finish == "stopped"
    assert len(texts) >= 3 and done.emitted < 800


def test_an_unreachable_remote_is_one_line_and_the_daemon_goes_on(front: Home) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    write_spec(front.path / "models" / "gone", dead, "demo")
    asked = front.colibri("ask", "--model", "gone", QUESTION)
    assert asked.returncode == 1
    lines = asked.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"colibri ask: REMOTE: cannot reach {dead}")
    with pytest.raises(openai.APIStatusError) as failed:
        front_openai(front).chat.completions.create(model="gone", messages=Q, max_tokens=4)
    assert failed.value.status_code == 502 and "cannot reach" in str(failed.value)
    # a remote that wants a key it is not sent: one line naming where the key goes
    write_spec(front.path / "models" / "keyless", front_upstream_url(front), "demo")
    refused = front.colibri("ask", "--model", "keyless", QUESTION)
    assert refused.returncode == 1 and "refused the API key (401" in refused.stderr
    assert "[remote.keyless]" in refused.stderr
    alive = front.colibri("ask", "--model", "team", "--max-tokens", "4", QUESTION)
    assert alive.returncode == 0, alive.stderr


def front_upstream_url(front: Home) -> str:
    return json.loads((front.path / "models" / "team" / "remote.json").read_text())["url"]


def test_ps_shows_the_remote_and_the_key_appears_nowhere(front: Home, upstream: Home) -> None:
    front.colibri("ask", "--model", "team", "--max-tokens", "4", QUESTION)
    ps = front.colibri("ps")
    assert ps.returncode == 0, ps.stderr
    assert f"remote: team at {upstream.url} (model demo)" in ps.stdout  # type: ignore[attr-defined]
    logs = front.colibri("logs")
    assert "remote team (" + upstream.url in logs.stdout  # type: ignore[attr-defined]
    shown = [
        ps.stdout,
        front.colibri("ps", "--json").stdout,
        front.colibri("list").stdout,
        front.colibri("list", "--json").stdout,
        logs.stdout,
        (front.path / "colibrid.log").read_text(),
        (front.path / "models" / "team" / "remote.json").read_text(),
        (front.path / "config.toml").read_text(),
    ]
    assert not [text for text in shown if KEY in text]
    pid = front.pid()
    assert pid is not None
    assert KEY not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_repl_on_a_remote_model_after_colibri_stop_loads_nothing(
    front: Home, tmp_path: Path
) -> None:
    """`colibri stop` unloads the local model; the REPL's next message to the remote model
    is answered by its endpoint, with no "no model is loaded; loading" notice (it used to
    say one) and nothing loaded here."""
    tmux = Tmux(f"colibri-test-{tmp_path.name}")
    command = (
        f"env COLIBRI_HOME={front.path} {sys.executable} -m colibri_cli repl --model team "
        "--max-tokens 4"
    )
    tmux.run("new-session", "-d", "-s", "repl", "-x", "150", "-y", "50", command)
    try:
        tmux.wait(lambda s: ">>>" in s)
        tmux.keys("first question", "Enter")
        tmux.wait(lambda s: s.count(">>>") >= 2)
        unloaded = front.colibri("stop")
        assert unloaded.returncode == 0, unloaded.stderr
        assert json.loads(front.colibri("ps", "--json").stdout)["model"] is None
        tmux.keys("second question", "Enter")
        screen = tmux.wait(lambda s: s.count(">>>") >= 3)
        after = screen.split("second question")[1]
        assert "no model is loaded" not in after and "error" not in after, screen
        status = json.loads(front.colibri("ps", "--json").stdout)
        assert status["model"] is None  # the remote answered; nothing was loaded
        assert status["remote"]["team"]["running"] == 0
    finally:
        tmux.run("kill-server")
        front.colibri("ask", "--max-tokens", "1", QUESTION)  # the local model back


def test_a_remote_model_cannot_be_the_default(tmp_path: Path, front: Home) -> None:
    home = Home(tmp_path / "h", front.path / "models" / "team")
    home.env["COLIBRI_NO_PULL"] = "1"
    (tmp_path / "h" / "models").mkdir()
    started = home.colibrid("start")
    assert started.returncode != 0
    assert "team is a remote model" in started.stderr and "Traceback" not in started.stderr
