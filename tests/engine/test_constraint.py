"""Constrained decoding (engine.constraint) on the demo model, in-process: 50 prompts over
5 schemas (objects, arrays, enums, nesting, bounded numbers) give JSON that validates,
greedy and sampled; a grammar's requests batched beside free ones answer as alone;
speculation stays lossless under a grammar; an answer cut by max_tokens ends "length";
the stop token is allowed only where the grammar accepts; a bad grammar is one line."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from structured_cases import SCHEMAS

from colibrid.engine import request_run as gen_module
from colibrid.engine.batcher import Batcher, Member
from colibrid.engine.constraint import Vocabulary
from colibrid.engine.engine import Engine
from colibrid.engine.events import DoneEvent, TokenEvent
from colibrid.engine.grammar import Grammar
from colibrid.engine.request_run import RequestRun
from colibrid.engine.sampling import SamplingParams
from colibrid.engine.speculate import OFF, SpecSettings
from colibrid.engine.tokenizer import StreamingDetokenizer, TextCodec
from colibrid.errors import RequestError


@pytest.fixture(scope="module")
def demo(demo_container):
    engine = Engine.load(demo_container)
    codec = TextCodec.load(demo_container, max_context=engine.max_context)
    vocab = Vocabulary(codec.tokenizer_json(), engine.vocab_size, codec.stop_token_ids)
    yield engine, codec, vocab
    engine.close()


class Record:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.pieces: list[str] = []
        self.done: DoneEvent | None = None
        self.failed: tuple[str, str] | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class Listener:
    def __init__(self) -> None:
        self.passes = 0

    def token(self, member: Member, event: TokenEvent) -> None:
        member.tag.tokens.append(event.token_id)
        member.tag.pieces.append(event.text)

    def done(self, member: Member, event: DoneEvent) -> None:
        member.tag.done = event

    def failed(self, member: Member, code: str, message: str) -> None:
        member.tag.failed = (code, message)

    def passed(self, members) -> None:  # noqa: ANN001
        self.passes += 1


def chat(codec: TextCodec, prompt: str) -> list[int]:
    return codec.encode_chat([{"role": "user", "content": prompt}])


def add(batch: Batcher, demo, ids, params, grammar=None, spec=OFF, session=None, ff=True):  # noqa: ANN001
    engine, codec, vocab = demo
    record = Record()
    steps = RequestRun(
        engine,
        ids,
        params,
        stop_token_ids=codec.stop_token_ids,
        detokenizer=StreamingDetokenizer(codec),
        costs=batch.costs,
        speculate=spec,
        session=session,
        constraint=(
            vocab.constraint(grammar.compile(), fast_forward=ff) if grammar is not None else None
        ),
    )
    batch.add(Member(steps, tag=record))
    return record


def run(batch: Batcher) -> None:
    while batch.members:
        batch.step()


def alone(demo, ids, params, grammar=None, spec=OFF, ff=True) -> Record:  # noqa: ANN001
    listener = Listener()
    batch = Batcher(demo[0], listener)
    record = add(batch, demo, ids, params, grammar, spec, ff=ff)
    run(batch)
    record.passes = listener.passes
    return record


# ---- without a model ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "build,message",
    [
        (
            lambda: Grammar.json_schema({"type": "nope"}).compile(),
            "invalid JSON schema: Invalid type: nope",
        ),
        (lambda: Grammar.json_schema([1]), "a JSON schema must be an object"),
        (lambda: Grammar.json_schema({"$ref": "#/x"}).compile(), "invalid JSON schema: "),
        (
            lambda: Grammar.lark("start: foo").compile(),
            'invalid Lark grammar: at 1(8): unknown name: "foo"',
        ),
        (lambda: Grammar.regex("a(b").compile(), "invalid regex: "),
        (lambda: Grammar.from_spec({"ebnf": "x"}), "a grammar is one of"),
        (lambda: Grammar.from_spec({"regex": "a", "lark": "b"}), "a grammar is one of"),
    ],
)
def test_a_bad_grammar_is_one_request_error_line(build, message) -> None:  # noqa: ANN001
    with pytest.raises(RequestError) as err:
        build()
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert err.value.code == "BAD_REQUEST"


def test_the_stop_token_is_allowed_only_where_the_grammar_accepts(demo) -> None:
    engine, codec, vocab = demo
    (stop,) = codec.stop_token_ids
    zeros = np.zeros(engine.vocab_size, dtype=np.float32)
    c = vocab.constraint(Grammar.regex("ab(cd)?").compile())
    allowed = lambda: set(np.flatnonzero(np.isfinite(c.apply(zeros))))  # noqa: E731
    assert stop not in allowed()
    c.advance(codec.encode("ab", add_special_tokens=False)[0])
    assert stop in allowed() and not c.complete, "accepting, and 'cd' may still follow"
    c.advance(codec.encode("cd", add_special_tokens=False)[0])
    assert allowed() == {stop} and c.complete
    assert c.stats().tokens == 2 and c.stats().mask_us > 0


# ---- the demo model ---------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_fifty_prompts_over_five_schemas_all_validate(demo, temperature: float) -> None:
    """All 50 in one batch (the prompt's chat prefix prefilled once and forked): every
    answer finishes "stop", parses and validates against its schema."""
    engine, codec, _ = demo
    first = chat(codec, "x")
    common = chat(codec, "y")
    prefix = next(i for i, (a, b) in enumerate(zip(first, common, strict=False)) if a != b)
    base = engine.new_session()
    base.prefill(first[:prefix])
    batch = Batcher(engine, Listener())
    records = []
    for name, (schema, max_tokens, prompts) in SCHEMAS.items():
        grammar = Grammar.json_schema(schema)
        for seed, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
            session = base.fork(prefix)
            record = add(batch, demo, chat(codec, prompt), params, grammar, session=session)
            records.append((name, schema, record))
    assert len(records) == 50
    run(batch)
    for name, schema, record in records:
        assert record.failed is None and record.done is not None, (name, record.failed)
        assert record.done.finish_reason == "stop", (name, record.text)
        jsonschema.validate(json.loads(record.text), schema)
        assert record.done.constraint is not None and record.done.constraint.tokens > 0


def test_grammar_requests_beside_free_ones_answer_as_alone(demo) -> None:
    _, codec, _ = demo
    person = Grammar.json_schema(SCHEMAS["object"][0])
    tags = Grammar.json_schema(SCHEMAS["array"][0])
    jobs = [
        (chat(codec, "Describe a doctor."), SamplingParams(max_tokens=40), person),
        (chat(codec, "Describe a doctor."), SamplingParams(max_tokens=12), None),
        (chat(codec, "Tags for a cat video."), SamplingParams(40, 0.8, seed=5), tags),
        (chat(codec, "Tell me a joke."), SamplingParams(12, 0.8, seed=5), None),
    ]
    want = [alone(demo, ids, params, grammar) for ids, params, grammar in jobs]
    batch = Batcher(demo[0], Listener())
    together = [add(batch, demo, ids, params, grammar) for ids, params, grammar in jobs]
    run(batch)
    for a, b in zip(want, together, strict=True):
        assert b.tokens == a.tokens and b.done.finish_reason == a.done.finish_reason
    assert want[0].text.startswith('{"name": "') and want[0].done.finish_reason == "stop"


class Replay:
    """A drafter proposing a known answer, wrong at its first place every other draft and
    at every third place otherwise (a prompt lookup stand-in that drafts often: kept
    drafts, refused drafts, drafts the grammar refuses)."""

    name = "ngram"
    free = True

    def __init__(self, prompt_len: int, answer: list[int]) -> None:
        self.prompt_len, self.answer, self.seen, self.calls = prompt_len, answer, 0, 0

    def feed(self, tokens) -> None:  # noqa: ANN001
        self.seen += len(tokens)

    def cost(self, depth: int) -> float:
        return 0.0

    def keep_up(self) -> None:
        pass

    def propose(self, limit: int) -> list[int]:
        # every other draft is wrong at once and the rest at every third token, so drafts
        # are rejected whatever depth the measured pass times choose (1 included)
        at = self.seen - self.prompt_len
        out = self.answer[at : at + limit]
        self.calls += 1
        wrong = 0 if self.calls % 2 == 0 else 2
        return [t + 1 if k % 3 == wrong else t for k, t in enumerate(out)]


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_speculation_under_a_grammar_changes_no_token(demo, monkeypatch, temperature) -> None:  # noqa: ANN001
    _, codec, _ = demo
    grammar = Grammar.json_schema(SCHEMAS["nested"][0])
    ids = chat(codec, "Tell me about Rome.")
    params = SamplingParams(max_tokens=64, temperature=temperature, seed=3)
    plain = alone(demo, ids, params, grammar)
    monkeypatch.setattr(gen_module, "PromptLookup", lambda: Replay(len(ids), plain.tokens))
    fast = alone(demo, ids, params, grammar, SpecSettings("ngram", 6))
    assert fast.tokens == plain.tokens and fast.done.finish_reason == "stop"
    spec = fast.done.spec
    assert spec is not None and spec.drafted > spec.accepted > 0, spec


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_forced_tokens_ride_one_pass_and_change_no_token(demo, temperature) -> None:  # noqa: ANN001
    """The grammar's forced text (`{"city": {"name": "`) is verified as drafts: the same
    tokens as one pass a token, in fewer passes."""
    _, codec, _ = demo
    grammar = Grammar.json_schema(SCHEMAS["nested"][0])
    ids = chat(codec, "Tell me about Tokyo.")
    params = SamplingParams(max_tokens=64, temperature=temperature, seed=4)
    slow = alone(demo, ids, params, grammar, ff=False)
    fast = alone(demo, ids, params, grammar)
    assert fast.tokens == slow.tokens and fast.done.finish_reason == "stop"
    assert slow.passes == len(slow.tokens), "one pass a token (the prompt's gives the first)"
    assert fast.passes < slow.passes - 5, (fast.passes, slow.passes)


def test_an_answer_cut_short_ends_length_not_stop(demo) -> None:
    _, codec, _ = demo
    schema = SCHEMAS["nested"][0]
    record = alone(demo, chat(codec, "Tell me about Paris."), SamplingParams(max_tokens=6), None)
    cut = alone(
        demo,
        chat(codec, "Tell me about Paris."),
        SamplingParams(max_tokens=6),
        Grammar.json_schema(schema),
    )
    assert cut.done.finish_reason == "length" and len(cut.tokens) == 6
    assert cut.text.startswith('{"city": {') and cut.text != record.text
    with pytest.raises(ValueError):
        json.loads(cut.text)
