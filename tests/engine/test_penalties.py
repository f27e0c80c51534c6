"""Repetition control, min-p and logprobs in the sampler (engine.penalties,
engine.logprobs): the formulas of the APIs that define them, the history each penalty
sees, and the logprobs of a real model checked against a softmax of its own logits."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.engine.engine import Engine
from colibrid.engine.generate import TokenEvent, generate
from colibrid.engine.sampling import Sampler, SamplingParams
from colibrid.errors import RequestError
from colibrid.store.options import StoreOptions


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    """llama.cpp's rule, on the last n context tokens, the prompt included."""
    logits = np.array([2.0, -2.0, 2.0, 1.0, 0.5], np.float32)
    s = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=2), context=[4, 0, 1])
    out = s.repetition.apply(logits)
    # the window holds the last two context tokens: 0 and 1 (4 fell out of it)
    np.testing.assert_array_equal(out, [1.0, -4.0, 2.0, 1.0, 0.5])
    assert s.sample(logits) == 2  # token 0 was the argmax; penalised, token 2 wins
    # 2 entered the window, 0 left it: now 0 ties 2 at 2.0 and 2 is halved
    np.testing.assert_array_equal(s.repetition.apply(logits), [2.0, -4.0, 1.0, 1.0, 0.5])


def test_openai_penalties_count_generated_tokens_only() -> None:
    """logit -= count * frequency + (count > 0) * presence, counts over the answer."""
    logits = np.array([3.0, 2.9, 0.0], np.float32)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    s = Sampler(p, context=[1, 1, 1])  # the prompt's tokens are not counted
    np.testing.assert_array_equal(s.repetition.apply(logits), logits)
    assert [s.sample(logits) for _ in range(3)] == [0, 1, 0]
    # 0 generated twice, 1 once: 3 - 2 * 0.5 - 0.25, 2.9 - 0.5 - 0.25
    np.testing.assert_allclose(s.repetition.apply(logits), [1.75, 2.15, 0.0], rtol=1e-6)


def test_a_masked_token_stays_masked_under_any_penalty() -> None:
    logits = np.array([-np.inf, 1.0, -1.0], np.float32)
    s = Sampler(
        SamplingParams(repeat_penalty=3.0, frequency_penalty=-2.0, presence_penalty=-2.0),
        context=[0],
    )
    s.repetition.accept(0)
    assert np.isneginf(s.repetition.apply(logits)[0])
    assert s.sample(logits) == 1


def test_min_p_keeps_only_tokens_near_the_best() -> None:
    """At temperature 1, over probabilities (0.5, 0.3, 0.2): min_p 0.7 keeps token 0 only
    (0.3 < 0.35); min_p 0.5 keeps 0 and 1, never 2 (0.2 < 0.25)."""
    row = np.log(np.array([0.5, 0.3, 0.2])).astype(np.float32)
    only = {
        Sampler(SamplingParams(temperature=1.0, min_p=0.7, seed=s)).sample(row) for s in range(50)
    }
    assert only == {0}
    two = {
        Sampler(SamplingParams(temperature=1.0, min_p=0.5, seed=s)).sample(row) for s in range(200)
    }
    assert two == {0, 1}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"repeat_penalty": 0.0}, "repeat_penalty"),
        ({"repeat_penalty": float("inf")}, "repeat_penalty"),
        ({"repeat_last_n": -2}, "repeat_last_n"),
        ({"repeat_last_n": 1.5}, "repeat_last_n"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"presence_penalty": True}, "presence_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_out_of_range_values_are_refused_with_the_field(kwargs, match) -> None:
    with pytest.raises(RequestError, match=match):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def engine(oracle_checkpoint):
    eng = Engine.load(oracle_checkpoint("glm4_moe").out_dir, store=StoreOptions(mode="resident"))
    yield eng
    eng.close()


def _tokens(engine, prompt, params) -> list[TokenEvent]:  # noqa: ANN001
    return [e for e in generate(engine, prompt, params) if isinstance(e, TokenEvent)]


def test_penalties_change_a_looping_answer_and_the_same_seed_repeats(engine) -> None:
    prompt = [int(t) for t in np.random.default_rng(4).integers(1, engine.vocab_size, 8)] * 4
    plain = [e.token_id for e in _tokens(engine, prompt, SamplingParams(max_tokens=24))]
    for params in (
        SamplingParams(max_tokens=24, repeat_penalty=1.5, repeat_last_n=-1),
        SamplingParams(max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0),
        SamplingParams(max_tokens=24, temperature=0.9, seed=3, repeat_penalty=1.3, min_p=0.05),
    ):
        first = [e.token_id for e in _tokens(engine, prompt, params)]
        again = [e.token_id for e in _tokens(engine, prompt, params)]
        assert first == again, params
        if params.greedy:
            assert first != plain, params
    # a strong presence penalty on greedy decoding: no token is generated twice in a row
    # of distinct choices while fresh ones remain (the vocabulary is far larger than 24)
    strong = SamplingParams(max_tokens=24, presence_penalty=2.0, frequency_penalty=2.0)
    ids = [e.token_id for e in _tokens(engine, prompt, strong)]
    assert len(set(ids)) > len(set(plain))


def test_logprobs_are_the_softmax_of_the_models_own_logits(engine) -> None:
    """The reference: the engine's logits for the prompt and each generated prefix,
    computed directly (a fresh session per prefix), log-softmaxed in float64."""
    prompt = [int(t) for t in np.random.default_rng(9).integers(1, engine.vocab_size, 12)]
    events = _tokens(engine, prompt, SamplingParams(max_tokens=6, logprobs=5))
    assert len(events) == 6
    context = list(prompt)
    for event in events:
        lp = event.logprobs
        assert lp is not None and lp.token_id == event.token_id
        session = engine.new_session()
        logits = np.asarray(session.prefill(context), np.float64)
        ref = logits - logits.max()
        ref -= np.log(np.exp(ref).sum())
        assert lp.logprob == pytest.approx(ref[event.token_id], abs=1e-6)
        best = np.argsort(-ref, kind="stable")[:5]
        assert [t for t, _ in lp.top] == [int(i) for i in best]
        np.testing.assert_allclose([v for _, v in lp.top], ref[best], atol=1e-6)
        assert lp.top[0][0] == event.token_id  # greedy: the chosen one is the best
        assert np.exp(ref).sum() == pytest.approx(1.0)
        context.append(event.token_id)
