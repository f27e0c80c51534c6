"""Crafted grammars against the real daemon (demo model, HTTP and SERVE at once).

Each used to stop the daemon for everyone: a 3,000-rule Lark chain (SERVE) and a
2,000-definition `$ref` chain (HTTP) overflowed llguidance's recursion (SIGSEGV); an
`allOf` of 100 patterns (HTTP) ran for minutes on the event loop, grew to GBs and died of
a Rust panic. Now the first are refused by the structural caps at once, and what the caps
cannot see (patterns intersected through `$ref`s) compiles in a grammar worker process
that misses its deadline or its memory limit, so it costs that request one line. In every
case: `/health` and other clients' requests are answered meanwhile, the daemon lives, its
memory stays bounded, and the next greedy answer is the one a fresh daemon gives.

The worker itself is also driven directly (`GrammarService`) with what the caps would
refuse: a grammar that crashes the compiler process (a 100,000-rule chain overflows even
its large stack) costs that grammar, and the next one compiles.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import trio
from colibri_protocol.messages import Submit
from daemon_helpers import Home, alive, serving_http

from colibri_cli.client import Client, ClientError
from colibrid.engine.grammar import Grammar
from colibrid.errors import RequestError
from colibrid.serve.grammars import GrammarLimits, GrammarService

PROMPT = "Name three colors."
TIMEOUT_S = 3.0  # grammar_timeout_s in these daemons


def lark_chain(rules: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(rules)) + f'r{rules}: "x"\n'


def ref_chain(defs: int) -> dict:
    chain = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(defs)}
    chain[f"d{defs}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": chain}


def all_of(patterns: int, *, through_refs: bool = False) -> dict:
    """A string that must match `patterns` patterns at once: deciding whether any can
    grows exponentially with their number. Through `$ref`s the caps do not count them."""
    each = [{"pattern": f".*{chr(97 + i % 26)}{i // 26 or ''}.*"} for i in range(patterns)]
    if not through_refs:
        return {"type": "string", "allOf": each}
    defs = {f"p{i}": p for i, p in enumerate(each)}
    return {"type": "string", "allOf": [{"$ref": f"#/$defs/{k}"} for k in defs], "$defs": defs}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def home(demo_container: Path, tmp_path_factory):
    yield from serving_http(
        tmp_path_factory.mktemp("grammar-bombs"),
        demo_container,
        grammar_timeout_s=TIMEOUT_S,
    )


def chat(home: Home, **extra) -> httpx.Response:  # noqa: ANN003
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 12,
        "temperature": 0,
        **extra,
    }
    return httpx.post(home.url + "/v1/chat/completions", json=body, timeout=120)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "bomb", "schema": schema}}


def greedy(home: Home) -> str:
    r = chat(home)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def fresh_answer(home: Home) -> str:
    """The greedy answer of the daemon before any bomb (what a fresh daemon says)."""
    return greedy(home)


class Watch:
    """While a bomb is in flight: /health polled, and plain requests over SERVE and HTTP
    made one after another, each timed."""

    def __init__(self, home: Home) -> None:
        self.home = home
        self.health: list[float] = []
        self.answers: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._poll), threading.Thread(target=self._ask)]

    def _poll(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            r = httpx.get(self.home.url + "/health", timeout=30)
            self.health.append(time.perf_counter() - t0)
            if r.status_code != 200:
                self.failures.append(f"/health {r.status_code}")
            time.sleep(0.05)

    def _ask(self) -> None:
        with Client.connect(self.home.socket, timeout_s=60) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    list(client.generate(Submit(client.next_id(), prompt="hi", max_tokens=2)))
                except ClientError as exc:
                    self.failures.append(f"SERVE {exc}")
                self.answers.append(time.perf_counter() - t0)

    def __enter__(self) -> Watch:
        for t in self._threads:
            t.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        assert not self.failures, self.failures
        assert self.health and max(self.health) < 1.0, self.health
        assert self.answers and max(self.answers) < 5.0, self.answers


def assert_one_line_refusal(message: str, words: str) -> None:
    assert "\n" not in message and len(message) <= 400, message
    assert words in message, message


def test_the_reported_bombs_are_refused_at_once(home: Home, fresh_answer: str) -> None:
    """The issue's three payloads, as sent: each a one-line refusal within a second."""
    before = rss_mb(home.pid())
    with Watch(home):
        t0 = time.perf_counter()
        with Client.connect(home.socket, timeout_s=60) as client:
            with pytest.raises(ClientError) as err:
                list(
                    client.generate(Submit("lark", prompt="hi", grammar={"lark": lark_chain(3000)}))
                )
        assert err.value.code == "BAD_REQUEST"
        assert_one_line_refusal(str(err.value), "grammar too complex: the Lark grammar has")
        for schema, words in (
            (ref_chain(2000), "definitions"),
            (all_of(100), "an allOf intersects 100 patterns"),
        ):
            r = chat(home, response_format=schema_format(schema))
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "response_format"
            assert_one_line_refusal(error["message"], words)
        assert time.perf_counter() - t0 < 3.0
    assert alive(home.pid())
    assert rss_mb(home.pid()) < before + 200
    assert greedy(home) == fresh_answer


def test_what_the_caps_cannot_see_costs_one_request(home: Home, fresh_answer: str) -> None:
    """24 patterns intersected through `$ref`s pass the caps and reach the grammar worker,
    which misses its deadline (or its memory limit): 400 within the deadline and a bit;
    the same bomb again is refused from the verdict cache, at once."""
    before = rss_mb(home.pid())
    bomb = schema_format(all_of(24, through_refs=True))
    with Watch(home):
        t0 = time.perf_counter()
        r = chat(home, response_format=bomb)
        first = time.perf_counter() - t0
        assert r.status_code == 400, r.text
        assert_one_line_refusal(r.json()["error"]["message"], "grammar too complex: compiling it")
        assert first < TIMEOUT_S + 3.0
        t0 = time.perf_counter()
        again = chat(home, response_format=bomb)
        assert again.status_code == 400 and time.perf_counter() - t0 < 1.0
        assert again.json()["error"]["message"] == r.json()["error"]["message"]
    assert alive(home.pid())
    assert rss_mb(home.pid()) < before + 200, "the compiling happened elsewhere"
    assert greedy(home) == fresh_answer
    ok = chat(home, response_format=schema_format({"type": "object"}))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"].startswith("{")


def test_the_same_bomb_over_serve_costs_that_request(home: Home) -> None:
    bomb = {"json_schema": all_of(22, through_refs=True)}
    with Client.connect(home.socket, timeout_s=60) as client:
        with pytest.raises(ClientError) as err:
            list(client.generate(Submit("bomb", prompt="hi", grammar=bomb)))
        assert err.value.code == "BAD_REQUEST"
        assert_one_line_refusal(str(err.value), "grammar too complex: compiling it")
        events = list(client.generate(Submit("after", prompt="hi", max_tokens=3)))
        assert events[-1].emitted == 3


# ---- the worker itself, past the caps ----------------------------------------------------
def test_a_compiler_crash_costs_that_grammar_and_the_next_one_compiles() -> None:
    """A 100,000-rule chain (what the caps refuse) overflows the compiler's stack: SIGSEGV
    in the worker process; this process, and the next grammar, are unaffected."""
    crash = Grammar("lark", "lark", lark_chain(100_000))

    async def main() -> None:
        service = GrammarService(GrammarLimits(workers=1, timeout_s=20.0))
        try:
            with pytest.raises(RequestError) as err:
                await service.check(crash)
            assert_one_line_refusal(str(err.value), "stopped the grammar compiler (SIGSEGV")
            compiled = await service.check(Grammar.regex("yes|no"))
            assert "yes|no" in compiled.source
            with pytest.raises(RequestError):  # remembered: not compiled again
                await service.check(crash)
            assert service.statistics()["cache_hits"] == 1
        finally:
            await service.aclose()

    trio.run(main)


def test_a_compiler_out_of_memory_is_a_refusal() -> None:
    async def main() -> None:
        service = GrammarService(GrammarLimits(workers=1, timeout_s=60.0, memory_mb=768))
        try:
            with pytest.raises(RequestError) as err:
                await service.check(Grammar.json_schema(all_of(24, through_refs=True)))
            assert_one_line_refusal(str(err.value), "grammar_memory_mb = 768")
        finally:
            await service.aclose()

    trio.run(main)
