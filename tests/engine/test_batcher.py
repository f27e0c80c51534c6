"""Continuous batching (engine.batcher) with a real model: requests decoded together get the
answers they get alone; members join and leave between steps; a cancel or a fault costs
its own request only; a prompt beside running requests is taken in chunks."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from colibrid.engine import batcher as batcher_module
from colibrid.engine.batcher import Batcher, Member
from colibrid.engine.engine import Engine
from colibrid.engine.events import DoneEvent, TokenEvent
from colibrid.engine.request_run import RequestRun
from colibrid.engine.sampling import SamplingParams
from colibrid.engine.speculate import OFF, SpecSettings
from colibrid.store.options import StoreOptions


class Record:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.done: DoneEvent | None = None
        self.failed: tuple[str, str] | None = None


class Listener:
    def __init__(self) -> None:
        self.passes: list[int] = []

    def token(self, member: Member, event: TokenEvent) -> None:
        member.tag.tokens.append(event.token_id)

    def done(self, member: Member, event: DoneEvent) -> None:
        member.tag.done = event

    def failed(self, member: Member, code: str, message: str) -> None:
        member.tag.failed = (code, message)

    def passed(self, members) -> None:  # noqa: ANN001
        self.passes.append(len(members))


@pytest.fixture(scope="module", params=["glm4_moe", "glm_moe_dsa"])
def engine(request, oracle_checkpoint):
    eng = Engine.load(
        oracle_checkpoint(request.param).out_dir, store=StoreOptions(mode="tiered", cache=2)
    )
    yield eng
    eng.close()


def prompts(engine, n: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(1, engine.vocab_size, 6 + 5 * k)] for k in range(n)]


def add(batch: Batcher, engine, prompt, params, *, spec=OFF, cancel=None) -> Record:  # noqa: ANN001
    record = Record()
    steps = RequestRun(engine, prompt, params, cancel=cancel, speculate=spec, costs=batch.costs)
    batch.add(Member(steps, cancel, tag=record, label=f"r{len(batch.members)}"))
    return record


def alone(engine, prompt, params, spec=OFF) -> list[int]:  # noqa: ANN001
    batch = Batcher(engine, Listener())
    record = add(batch, engine, prompt, params, spec=spec)
    while batch.members:
        batch.step()
    return record.tokens


def test_together_equals_alone_with_joins_and_speculation(engine) -> None:
    params = [
        SamplingParams(max_tokens=12 + 3 * k, temperature=0.7 * (k % 2), seed=k) for k in range(4)
    ]
    ps = prompts(engine, 4)
    want = [alone(engine, p, q) for p, q in zip(ps, params, strict=True)]
    listener = Listener()
    batch = Batcher(engine, listener)
    records = [add(batch, engine, ps[0], params[0]), add(batch, engine, ps[1], params[1])]
    for _ in range(3):
        batch.step()
    records += [  # join mid-way, one of them speculating
        add(batch, engine, ps[2], params[2]),
        add(batch, engine, ps[3], params[3], spec=SpecSettings("ngram", 4)),
    ]
    while batch.members:
        batch.step()
    assert [r.tokens for r in records] == want
    assert all(r.done is not None and r.failed is None for r in records)
    assert max(listener.passes) == 4, "all four shared passes"


def test_together_equals_alone_with_penalties(engine) -> None:
    """Each request's penalties see its own history only, so a batch changes no token;
    and the penalties do change the tokens (else this would prove nothing)."""
    params = [
        SamplingParams(max_tokens=16, repeat_penalty=1.8, repeat_last_n=-1),
        SamplingParams(max_tokens=16, temperature=0.8, seed=5, frequency_penalty=1.5, min_p=0.1),
        SamplingParams(max_tokens=16, presence_penalty=-2.0, repeat_penalty=1.2, repeat_last_n=4),
    ]
    ps = [p * 2 for p in prompts(engine, 3)]  # a repeated prompt: the window has work to do
    want = [alone(engine, p, q) for p, q in zip(ps, params, strict=True)]
    plain = [alone(engine, p, SamplingParams(max_tokens=16)) for p in ps]
    assert want[0] != plain[0] or want[2] != plain[2], "the penalties changed nothing"
    batch = Batcher(engine, Listener())
    records = [add(batch, engine, ps[0], params[0])]
    batch.step()
    records += [
        add(batch, engine, ps[1], params[1], spec=SpecSettings("ngram", 4)),
        add(batch, engine, ps[2], params[2], spec=SpecSettings("ngram", 4)),
    ]
    while batch.members:
        batch.step()
    assert [r.tokens for r in records] == want


def test_a_long_prompt_is_taken_in_chunks_beside_decoding_requests(engine, monkeypatch) -> None:
    monkeypatch.setattr(batcher_module, "PREFILL_CHUNK", 8)
    rng = np.random.default_rng(3)
    long_prompt = [int(t) for t in rng.integers(1, engine.vocab_size, 40)]
    short = prompts(engine, 1)[0]
    params = SamplingParams(max_tokens=10)
    want = [alone(engine, short, params), alone(engine, long_prompt, params)]
    batch = Batcher(engine, Listener())
    first = add(batch, engine, short, params)
    batch.step()  # the short prompt alone: whole
    second = add(batch, engine, long_prompt, params)
    for _ in range(3):  # a token is handed out when its request is next advanced
        batch.step()
    assert second.tokens == [] and len(first.tokens) == 3, "chunks, and the first kept decoding"
    while batch.members:
        batch.step()
    assert [first.tokens, second.tokens] == want


def test_a_cancel_costs_its_request_only(engine) -> None:
    params = SamplingParams(max_tokens=16)
    ps = prompts(engine, 3)
    want = [alone(engine, p, params) for p in ps]
    batch = Batcher(engine, Listener())
    flag = threading.Event()
    records = [add(batch, engine, ps[0], params), add(batch, engine, ps[1], params, cancel=flag)]
    records.append(add(batch, engine, ps[2], params))
    for _ in range(4):
        batch.step()
    flag.set()
    while batch.members:
        batch.step()
    assert records[1].done.finish_reason == "cancelled"
    assert records[1].tokens == want[1][: len(records[1].tokens)]
    assert [records[0].tokens, records[2].tokens] == [want[0], want[2]]


class FaultyFlag(threading.Event):
    """A cancel flag whose n-th check raises: a fault inside that request's pass."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.left = after

    def is_set(self) -> bool:
        self.left -= 1
        if self.left == 0:
            raise RuntimeError("injected fault")
        return super().is_set()


def test_a_fault_in_one_request_fails_it_alone(engine) -> None:
    params = SamplingParams(max_tokens=12)
    ps = prompts(engine, 3)
    want = [alone(engine, p, params) for p in ps]
    batch = Batcher(engine, Listener())
    records = [add(batch, engine, ps[0], params)]
    records.append(add(batch, engine, ps[1], params, cancel=FaultyFlag(9)))
    records.append(add(batch, engine, ps[2], params))
    while batch.members:
        batch.step()
    assert records[1].failed is not None and "injected fault" in records[1].failed[1]
    assert [records[0].tokens, records[2].tokens] == [want[0], want[2]]
    engine.experts.check_consistency()


def test_an_untraced_fault_isolates_then_fails_the_culprit(engine, monkeypatch) -> None:
    """A pass raising with no request to blame: its requests run one a pass until the
    failing one shows itself; the others finish with their own answers."""
    params = SamplingParams(max_tokens=8)
    ps = prompts(engine, 3)
    want = [alone(engine, p, params) for p in ps]
    batch = Batcher(engine, Listener())
    records = [add(batch, engine, p, params) for p in ps]
    poisoned = records[1]
    real_run = engine.run

    def run(forwards, hook=None):  # noqa: ANN001, ANN202
        mine = {id(m.forward.session) for m in batch.members if m.tag is poisoned and m.forward}
        if any(id(f.session) in mine for f in forwards) and len(poisoned.tokens) >= 3:
            raise RuntimeError("a bug in one request's pass")
        return real_run(forwards, hook)

    monkeypatch.setattr(engine, "run", run)
    while batch.members:
        batch.step()
    assert poisoned.failed is not None and "a bug" in poisoned.failed[1]
    assert [records[0].tokens, records[2].tokens] == [want[0], want[2]]
