"""docs/api-fields.md against the real daemon: every row's example, merged into a small
valid request of its dialect, is answered 200 when the row says honoured and 400 with one
line naming the field when it says refused. A field added to a translator without a row,
or a row whose behaviour drifted, fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from daemon_helpers import serving_http

MODEL = "model"  # the chat_model fixture's directory name
DOC = Path(__file__).resolve().parents[2] / "docs" / "api-fields.md"
ROUTES = {
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
    },
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
    "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 4},
    # Ollama streams unless told not to; its errors are {"error": "<message>"}
    "/api/chat": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "options": {"num_predict": 2},
        "stream": False,
    },
    "/api/generate": {
        "model": MODEL,
        "prompt": "Hi",
        "options": {"num_predict": 2},
        "stream": False,
    },
    "/v1/messages": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
    },
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
}
SECTION = re.compile(r"^## .*\(`POST (\S+)`\)")


def rows() -> list[tuple[str, str, str, dict]]:
    """(route, field, status, example) for every row of the doc that has an example."""
    out, route = [], None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        head = SECTION.match(line)
        if head:
            route = head.group(1)
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if route is None or len(cells) < 4 or not cells[0].startswith("`"):
            continue
        field, status, example = cells[0].strip("`"), cells[1], cells[-1]
        assert status in ("honoured", "refused"), line
        if example != "—":
            out.append((route, field, status, json.loads(example.strip("`"))))
    return out


ROWS = rows()


def test_the_doc_covers_each_dialect() -> None:
    seen = {route for route, *_ in ROWS}
    assert seen >= set(ROUTES), seen
    assert len(ROWS) > 50


@pytest.fixture(scope="module")
def url(chat_model: Path, tmp_path_factory):
    for home in serving_http(tmp_path_factory.mktemp("fields"), chat_model, max_queue=32):
        yield home.url


@pytest.mark.parametrize(
    "route, field, status, example",
    ROWS,
    ids=[f"{route.rsplit('/', 1)[-1]}-{field}" for route, field, *_ in ROWS],
)
def test_each_field_is_honoured_or_refused_in_one_line(url, route, field, status, example):
    body = {**ROUTES[route], **example}
    if isinstance(example.get("options"), dict):  # merged into the base request's options
        body["options"] = {**ROUTES[route].get("options", {}), **example["options"]}
    headers = {"anthropic-version": "2023-06-01"} if route == "/v1/messages" else {}
    r = httpx.post(url + route, json=body, headers=headers, timeout=120)
    ollama = route.startswith("/api/")  # Ollama's errors: {"error": "<message>"}
    if status == "honoured":
        if field in ("tools", "tool_choice") and r.status_code == 400:
            # the tiny model's context (256 tokens) cannot hold the tools the template
            # shows: the prompt grew by them, which is the field honoured, not refused
            error = r.json()["error"]
            assert ("context" in error) if ollama else error["code"] == "context_length_exceeded"
            return
        assert r.status_code == 200, (field, r.text)
        if route.endswith("/count_tokens"):
            assert r.json()["input_tokens"] > 0, r.text
        elif not body.get("stream"):
            assert r.json()["model"] == MODEL
        return
    assert r.status_code == 400, (field, r.status_code, r.text[:300])
    error = r.json()["error"]
    message = error if ollama else error["message"]
    assert "\n" not in message and f"{field}" in message, message
    if not route.startswith("/v1/messages") and not ollama:
        assert error.get("param") == field, error
