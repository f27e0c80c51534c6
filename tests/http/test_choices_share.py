"""OpenAI's `n` prefills the prompt once: choice 0 computes it and the other choices start
from a copy of its KV (serve.host), through the real daemon and the official openai SDK.

What must hold: `/metrics` counts the prompt's tokens prefilled once for n = 4 (and four
times for four separate requests); choice i is the answer of the n = 1 request with seed
+ i, on a daemon without the prompt cache and speculation and on one with both (so the
fork changes no token, speculation stays lossless on forked KV, and the prompt cache
still answers the prompt afterwards); a dropped stream or a failing choice ends every
choice and changes nothing a later request computes.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from daemon_helpers import Home, start_http, wait_for
from prometheus_client.parser import text_string_to_metric_families

MODEL = "model"
FAULT = "tell me about the faulty lighthouse"
# long enough that its prefill is several chunks of work, short enough for the tiny
# model's context of 256 tokens (its tokenizer is byte-level: about a token a byte)
QUESTION = "Ships logged at dawn: " + ", ".join(str(i * 7) for i in range(20)) + ". Which last?"
SEED = 21


def _home(tmp_path_factory, chat_model, name: str, **settings: object) -> Home:
    return start_http(
        tmp_path_factory.mktemp(name), chat_model, max_queue=32, max_active=4, **settings
    )


@pytest.fixture(scope="module")
def cold(chat_model, tmp_path_factory):
    """Every request prefills what it needs: no prompt cache, no speculation; a choice
    0 whose prompt holds FAULT fails inside its prefill."""
    home = _home(
        tmp_path_factory,
        chat_model,
        "cold",
        prompt_cache=False,
        speculate="off",
        debug_layer_delay_s=0.005,  # a dropped stream is noticed mid-answer
        debug_fail_prompt=FAULT,
        debug_fail_after=2,
    )
    yield home
    home.close()


@pytest.fixture(scope="module")
def warm(chat_model, tmp_path_factory):
    """The defaults users run: the prompt cache on, speculation where the model drafts."""
    home = _home(tmp_path_factory, chat_model, "warm", speculate="auto")
    yield home
    home.close()


def client(home: Home) -> openai.OpenAI:
    return openai.OpenAI(base_url=home.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metric(home: Home, name: str) -> float:
    text = httpx.get(home.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (name, name + "_total"):
                return sample.value
    raise AssertionError(f"/metrics has no {name}")


def chat(home: Home, question: str = QUESTION, **kw) -> openai.types.chat.ChatCompletion:  # noqa: ANN003
    messages = [{"role": "user", "content": question}]
    params = {"max_tokens": 20, "temperature": 0.9, "seed": SEED, **kw}
    return client(home).chat.completions.create(model=MODEL, messages=messages, **params)


def choices_once(home: Home, **kw) -> list[str]:  # noqa: ANN003
    """An n = 4 answer whose prompt was prefilled once (checked on /metrics)."""
    before = metric(home, "colibri_prefill_tokens")
    r = chat(home, n=4, **kw)
    assert metric(home, "colibri_prefill_tokens") - before == r.usage.prompt_tokens
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    return [c.message.content for c in r.choices]


def test_choices_prefill_once_and_equal_their_seeded_requests(cold, warm) -> None:
    shared = choices_once(cold)
    # four separate requests (n = 1, seed + i) each prefill the whole prompt
    before = metric(cold, "colibri_prefill_tokens")
    alone = [chat(cold, seed=SEED + i) for i in range(4)]
    assert metric(cold, "colibri_prefill_tokens") - before == 4 * alone[0].usage.prompt_tokens
    assert shared == [r.choices[0].message.content for r in alone]
    assert len(set(shared)) > 1  # the seeds differ, so do the answers: the check has teeth
    # the same on the daemon users run (prompt cache, speculation), streamed too
    assert choices_once(warm) == shared
    stream = client(warm).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=20,
        temperature=0.9,
        seed=SEED + 100,
        n=4,
        stream=True,
    )
    got = {i: "" for i in range(4)}
    for chunk in stream:
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
    assert [got[i] for i in range(4)] == [
        chat(cold, seed=SEED + 100 + i).choices[0].message.content for i in range(4)
    ]
    # the prompt cache still answers the prompt: nothing prefilled, choice 0's answer again
    before = metric(warm, "colibri_prefill_tokens")
    again = chat(warm)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    assert metric(warm, "colibri_prefill_tokens") == before
    assert again.choices[0].message.content == shared[0]


def test_a_dropped_stream_ends_every_choice(cold) -> None:
    before = cold.log().count("failed CANCELLED")
    with httpx.stream(
        "POST",
        cold.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 200,
            "temperature": 0.9,
            "n": 4,
            "stream": True,
        },
        timeout=60,
    ) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the stream started; the client then goes away
    assert wait_for(lambda: metric(cold, "colibri_running_requests") == 0, timeout_s=60)
    assert wait_for(lambda: cold.log().count("failed CANCELLED") - before == 4, timeout_s=10)
    assert choices_once(cold) == [
        chat(cold, seed=SEED + i).choices[0].message.content for i in range(4)
    ]


def test_a_failing_choice_ends_them_all_and_changes_nothing_after(cold) -> None:
    expected = [chat(cold, seed=SEED + i).choices[0].message.content for i in range(4)]
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        chat(cold, FAULT, n=4)
    assert wait_for(lambda: metric(cold, "colibri_running_requests") == 0, timeout_s=60)
    assert choices_once(cold) == expected
