"""Penalties, min_p, logprobs and n > 1 through the real daemon: the official openai
client, the SERVE protocol's LOGPROBS lines, and the demo model's chat commands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from colibri_protocol.messages import Data, Logprobs, Submit
from daemon_helpers import serving_http

from colibri_cli.client import Client

MODEL = "model"
HI = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def home(chat_model: Path, tmp_path_factory):
    yield from serving_http(
        tmp_path_factory.mktemp("sampling"), chat_model, max_queue=32, max_active=4
    )


@pytest.fixture(scope="module")
def oai(home):
    return openai.OpenAI(base_url=home.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(oai, **kw) -> openai.types.chat.ChatCompletion:  # noqa: ANN001
    return oai.chat.completions.create(model=MODEL, messages=HI, **{"max_tokens": 24, **kw})


def test_penalties_change_the_answer_and_the_same_seed_repeats(oai) -> None:
    plain = chat(oai, temperature=0).choices[0].message.content
    assert chat(oai, temperature=0, frequency_penalty=0).choices[0].message.content == plain
    for kw in (
        {"presence_penalty": -2.0, "frequency_penalty": -2.0},
        {"extra_body": {"repeat_penalty": 0.5, "repeat_last_n": -1}},
    ):
        changed = chat(oai, temperature=0, **kw).choices[0].message.content
        assert changed != plain, kw
        assert chat(oai, temperature=0, **kw).choices[0].message.content == changed
    seeded = {
        "temperature": 0.9,
        "seed": 5,
        "frequency_penalty": 1.0,
        "extra_body": {"min_p": 0.05},
    }
    assert chat(oai, **seeded).choices[0].message.content == (
        chat(oai, **seeded).choices[0].message.content
    )


def test_n_choices_with_derived_seeds_streamed_and_not(oai) -> None:
    r = chat(oai, n=3, temperature=0.9, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    # choice i is the n = 1 answer with seed + i
    assert texts == [
        chat(oai, temperature=0.9, seed=11 + i).choices[0].message.content for i in range(3)
    ]
    assert r.usage.completion_tokens == sum(
        chat(oai, temperature=0.9, seed=11 + i).usage.completion_tokens for i in range(3)
    )
    stream = chat(
        oai, n=3, temperature=0.9, seed=11, stream=True, stream_options={"include_usage": True}
    )
    got, finishes, usage = {0: "", 1: "", 2: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert [got[i] for i in range(3)] == texts and set(finishes) == {0, 1, 2}
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens
    greedy = chat(oai, n=2, temperature=0)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    done = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=5, n=2, seed=3)
    assert [c.index for c in done.choices] == [0, 1]


def test_logprobs_streamed_equal_whole_and_describe_the_text(oai) -> None:
    r = chat(oai, temperature=0, logprobs=True, top_logprobs=4)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert text.startswith(r.choices[0].message.content)
    for e in content:  # greedy: the chosen token is the likeliest, alternatives descend
        assert len(e.top_logprobs) == 4 and e.top_logprobs[0].token == e.token
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    streamed = []
    for chunk in chat(oai, temperature=0, logprobs=True, top_logprobs=4, stream=True):
        for c in chunk.choices:
            streamed += c.logprobs.content if c.logprobs and c.logprobs.content else []
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    legacy = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and all(len(t) <= 2 for t in lp.top_logprobs)


def test_serve_sends_a_logprobs_line_per_token(home) -> None:
    with Client.connect(home.socket) as client:
        submit = Submit("lp1", messages=tuple(HI), max_tokens=6, logprobs=3, repeat_penalty=1.2)
        events = list(client.generate(submit))
    lines = [e for e in events if isinstance(e, Logprobs)]
    assert len(lines) == 6 and all(len(e.top) == 3 for e in lines)
    text = "".join(e.text for e in events if isinstance(e, Data))
    joined = b"".join(e.chosen.bytes for e in lines).decode("utf-8", errors="replace")
    assert joined.startswith(text) or text.startswith(joined[: len(text)])


def test_the_chat_commands_break_the_demo_loop(demo_home: Path) -> None:
    """`colibri ask` defaults to repeat_penalty 1.1 over 64 tokens: the demo's greedy
    answer stops repeating itself; `--repeat-penalty 1` gives the loop back."""
    env = {**os.environ, "COLIBRI_HOME": str(demo_home), "COLIBRI_NO_PULL": "1"}
    prompt = "Tell me about the history of Paris."

    def ask(*flags: str) -> str:
        r = subprocess.run(
            [sys.executable, "-m", "colibri_cli", "ask", "--max-tokens", "160", *flags, prompt],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    try:
        looping, default = ask("--repeat-penalty", "1"), ask()
        assert ask() == default  # greedy with a penalty is deterministic

        def repeats(text: str) -> int:
            sentences = [s.strip() for s in text.split(".") if s.strip()]
            return len(sentences) - len(set(sentences))

        assert repeats(looping) >= 3 and repeats(default) == 0, (looping, default)
    finally:
        subprocess.run(
            [sys.executable, "-m", "colibrid", "stop"], env=env, capture_output=True, timeout=60
        )
