"""A Rust panic inside a native library costs the request that met it, nothing else.

pyo3 raises a panic as `PanicException`, a BaseException that every `except Exception`
lets through: a model whose tokenizer.json has a catastrophic pre-tokenizer regex used to
panic in `tokenizers` on a 41-character prompt and take the daemon down (and `colibrid
generate` printed a 90-line Rust backtrace). Here, through the real daemon (HTTP and
SERVE): that request fails with one INTERNAL line, /health answers, the daemon lives, and
the next request answers as a fresh daemon does; `colibrid generate` prints one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from colibri_protocol.messages import Submit
from daemon_helpers import Home, alive, serving_http

from colibri_cli.client import Client, ClientError
from colibrid.errors import NativePanic, contain_panics, is_native_panic

BOMB = "a" * 41  # backtracks past onig's retry limit against (a+)+b
SPLIT = {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated", "invert": False}


@pytest.fixture(scope="module")
def panicky_model(demo_container: Path, tmp_path_factory) -> Path:
    """The demo with a pre-tokenizer whose regex backtracks catastrophically (its other
    files are hard links: the same bytes, inside the folder)."""
    model = tmp_path_factory.mktemp("panicky") / "model"
    model.mkdir()
    for f in demo_container.iterdir():
        if f.is_file() and f.name != "tokenizer.json":
            os.link(f, model / f.name)
    tokenizer = json.loads((demo_container / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"]["pretokenizers"].insert(0, SPLIT)
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    return model


@pytest.fixture(scope="module")
def home(panicky_model: Path, tmp_path_factory):
    yield from serving_http(tmp_path_factory.mktemp("panics"), panicky_model)


def chat(home: Home, content: str) -> httpx.Response:
    body = {
        "model": "model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
    }
    return httpx.post(home.url + "/v1/chat/completions", json=body, timeout=120)


def test_a_tokenizer_panic_costs_one_request(home: Home) -> None:
    fresh = chat(home, "Name a color.")
    assert fresh.status_code == 200, fresh.text
    r = chat(home, BOMB)
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert "the model's tokenizer failed" in message and "\n" not in message, message
    with Client.connect(home.socket, timeout_s=60) as client:
        with pytest.raises(ClientError) as err:
            list(client.generate(Submit("bomb", prompt=BOMB, max_tokens=4)))
        assert err.value.code == "INTERNAL" and "tokenizer failed" in str(err.value)
        events = list(client.generate(Submit("after", prompt="hi", max_tokens=3)))
        assert events[-1].emitted == 3
    assert httpx.get(home.url + "/health", timeout=5).status_code == 200
    assert alive(home.pid())
    again = chat(home, "Name a color.")
    assert again.json()["choices"][0]["message"] == fresh.json()["choices"][0]["message"]


def test_colibrid_generate_says_one_line(panicky_model: Path, tmp_path: Path) -> None:
    h = Home(tmp_path / "home", panicky_model)
    env = {**h.env, "RUST_BACKTRACE": "1"}  # as in many shells: the report would be long
    r = subprocess.run(
        [sys.executable, "-m", "colibrid", "generate", "--model", str(panicky_model)]
        + ["--prompt", BOMB, "--max-tokens", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("colibrid: error: the model's tokenizer failed: Onig:"), r.stderr


def test_contain_panics_turns_a_panic_into_a_request_error() -> None:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(a+)+b"), behavior="isolated")
    with pytest.raises(BaseException) as raw:
        tok.encode(BOMB)
    assert is_native_panic(raw.value) and not isinstance(raw.value, Exception)
    with pytest.raises(NativePanic) as err, contain_panics("the tokenizer"):
        tok.encode(BOMB)
    assert err.value.code == "INTERNAL" and str(err.value).startswith("the tokenizer failed:")
    with pytest.raises(KeyError), contain_panics("anything"):  # others pass unchanged
        raise KeyError("x")
