"""Property-based: schemathesis generates requests from `/openapi.json` against the real
daemon; no answer may be a 500, none may hang, every error has an OpenAI-style body."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import schemathesis
from daemon_helpers import serving_http
from hypothesis import HealthCheck, given, settings


@pytest.fixture(scope="module")
def home(chat_model: Path, tmp_path_factory):
    yield from serving_http(
        tmp_path_factory.mktemp("f"),
        chat_model,
        max_queue=32,
        max_active=4,
        http_max_body_bytes=65536,
    )


def test_no_500_no_hang(home) -> None:
    """Every operation, 12 generated cases each (schemathesis strategies under
    hypothesis; its pytest plugin does not load on this pytest)."""
    schema = schemathesis.openapi.from_url(home.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    spec = httpx.get(home.url + "/openapi.json").json()
    assert len(operations) == sum(len(methods) for methods in spec["paths"].values()) >= 8

    for operation in operations:

        @given(operation.as_strategy())
        @settings(
            max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def check(case) -> None:
            response = case.call(base_url=home.url, timeout=30)
            assert response.status_code < 500, (case.path, response.text)
            if response.status_code >= 400:
                assert response.json()["error"]["message"]

        check()
    assert httpx.get(home.url + "/health").status_code == 200
    metrics = httpx.get(home.url + "/metrics").text
    answered = sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("colibri_http_requests_total{")
    )
    assert answered >= 40  # the cases really went over the wire
