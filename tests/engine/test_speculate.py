"""Speculative decoding (engine.speculate): drafts never change a token or a random draw,
whatever the drafter proposes and however deep; the depth follows measured costs."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.engine.engine import Engine
from colibrid.engine.generate import DoneEvent, TokenEvent, generate
from colibrid.engine.sampling import SamplingParams
from colibrid.engine.speculate import (
    OFF,
    Acceptance,
    PassCosts,
    PromptLookup,
    SpecSettings,
    best_depth,
)
from colibrid.errors import RequestError
from colibrid.store.options import StoreOptions


# ---- the parts ----------------------------------------------------------------------------
def test_prompt_lookup_continues_the_latest_earlier_occurrence() -> None:
    d = PromptLookup()
    d.feed([5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 4, 5, 6])
    assert d.propose(3) == [7, 3, 4]  # (5, 6) last followed by 7, 3, 4 (the later copy)
    d.feed([7, 3])
    assert d.propose(8) == [4, 5, 6, 7, 3]  # (6, 7, 3) -> cut at the end of the context
    d.feed([99])
    assert d.propose(4) == []  # nothing seen ends like (3, 99)
    assert PromptLookup().propose(4) == []


def test_pass_costs_interpolate_and_extrapolate() -> None:
    c = PassCosts()
    assert c.seconds(1) is None and c.seconds(0) == 0.0
    c.observe(1, 0.010)
    assert c.seconds(3) == pytest.approx(0.010 + 2 * 0.5 * 0.010)  # the prior slope
    c.observe(5, 0.030)
    assert c.seconds(3) == pytest.approx(0.020)  # between two measured sizes
    assert c.seconds(7) == pytest.approx(0.040)  # on the measured slope
    c.observe(500, 9.0)  # a prefill: not a verify's cost
    assert c.seconds(7) == pytest.approx(0.040)


def test_acceptance_prior_follows_the_depth_before() -> None:
    a = Acceptance()
    assert a.rate(1) == pytest.approx(0.5)
    for _ in range(20):
        a.observe(1, 1)  # one draft a step, always kept
    assert a.rate(1) > 0.9 and a.rate(2) > 0.85, "an untried depth looks as good as the last"
    assert a.expected_tokens(3) > 3.4


def test_best_depth_prices_rows_against_the_pass_time() -> None:
    sure = Acceptance()
    for _ in range(50):
        sure.observe(8, 8)
    streamed, resident = PassCosts(), PassCosts()
    for rows in range(1, 10):
        streamed.observe(rows, 0.30 + 0.01 * rows)  # reads shared: rows cost little
        resident.observe(rows, 0.010 * rows)  # arithmetic: each row costs a whole step
    assert best_depth(sure, streamed, 0, 8)[0] == 8
    assert best_depth(sure, resident, 0, 8)[0] <= 1
    doubtful = Acceptance()
    for _ in range(50):
        doubtful.observe(1, 0)
    assert best_depth(doubtful, streamed, 0, 8) == (0, 1.0)
    depth, gain = best_depth(sure, streamed, 0, 8, draft_cost=lambda d: 1.0 * d)
    assert depth == 0 and gain == 1.0, "a drafter slower than it saves is not used"


def test_settings_are_checked() -> None:
    with pytest.raises(RequestError, match="speculate must be"):
        SpecSettings("maybe")
    with pytest.raises(RequestError, match="draft depth"):
        SpecSettings("ngram", 0)
    assert not OFF.on and SpecSettings().on


# ---- through the engine -------------------------------------------------------------------
def _run(engine, prompt, params, spec, **kw):
    events = list(generate(engine, prompt, params, speculate=spec, **kw))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return [e.token_id for e in events if isinstance(e, TokenEvent)], done


class ScriptedDrafter:
    """Proposes the answer it is given, wrong at every `wrong`-th position: drafts that are
    kept, drafts that are rejected at every depth, bonus tokens after full acceptance."""

    name = "ngram"
    free = True

    def __init__(self, prompt_len: int, answer: list[int], wrong: int, vocab: int) -> None:
        self.prompt_len, self.answer, self.wrong, self.vocab = prompt_len, answer, wrong, vocab
        self.seen = 0

    def feed(self, tokens) -> None:  # noqa: ANN001
        self.seen += len(tokens)

    def cost(self, depth: int) -> float:
        return 0.0

    def keep_up(self) -> None:
        pass

    def propose(self, limit: int) -> list[int]:
        at = self.seen - self.prompt_len  # answer tokens emitted so far
        out = []
        for k in range(at, min(at + limit, len(self.answer))):
            bad = self.wrong and k % self.wrong == self.wrong - 1
            out.append((self.answer[k] + 1) % self.vocab if bad else self.answer[k])
        return out


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3", "glm_moe_dsa", "deepseek_v32"])
def test_speculation_changes_no_token(oracle_checkpoint, monkeypatch, arch) -> None:
    """Drafts right, wrong at every third and fifth place, and from prompt lookup; greedy
    and sampled (same seed): the text is the one without speculation, and a request that
    ends inside a verify leaves its session holding what one without would."""
    import colibrid.engine.request_run as gen_module

    engine = Engine.load(oracle_checkpoint(arch).out_dir, store=StoreOptions(mode="resident"))
    try:
        base = [int(t) for t in np.random.default_rng(1).integers(1, engine.vocab_size, 10)]
        prompt = base * 3
        for params in (
            SamplingParams(max_tokens=40),
            SamplingParams(max_tokens=40, temperature=0.9, seed=11),
            SamplingParams(max_tokens=7),
            # penalties see each verified row's own history (engine.penalties)
            SamplingParams(max_tokens=40, repeat_penalty=1.5, repeat_last_n=16),
            SamplingParams(
                max_tokens=40,
                temperature=0.9,
                seed=11,
                repeat_penalty=1.3,
                frequency_penalty=0.8,
                presence_penalty=0.4,
                min_p=0.05,
            ),
        ):
            plain_session = engine.new_session()
            plain, d0 = _run(engine, prompt, params, OFF, session=plain_session)
            for wrong in (0, 3, 5, None):
                if wrong is not None:
                    monkeypatch.setattr(
                        gen_module,
                        "PromptLookup",
                        lambda w=wrong, a=plain: ScriptedDrafter(
                            len(prompt), a, w, engine.vocab_size
                        ),
                    )
                else:
                    monkeypatch.undo()
                session = engine.new_session()
                fast, d1 = _run(engine, prompt, params, SpecSettings("ngram", 6), session=session)
                assert fast == plain and d1.finish_reason == d0.finish_reason, (params, wrong)
                assert session.tokens == plain_session.tokens, (params, wrong)
                st = d1.spec
                assert st.accepted <= st.drafted
                if wrong == 0 and params.max_tokens > 7:
                    assert st.verifies and st.accepted == st.drafted, "right drafts are kept"
                if wrong == 3:
                    assert st.drafted > st.accepted > 0
    finally:
        engine.close()


def test_speculation_on_a_streamed_store(oracle_checkpoint) -> None:
    """Verify passes through the tiered store with a one-expert cache: the union of the
    rows' experts is read, and the text is the resident store's."""
    ref = oracle_checkpoint("glm_moe_dsa")
    prompt = [3, 9, 4, 7, 3, 9, 4, 7, 3, 9, 4, 7, 3, 9]
    params = SamplingParams(max_tokens=30)
    resident = Engine.load(ref.out_dir, store=StoreOptions(mode="resident"))
    try:
        want, _ = _run(resident, prompt, params, OFF)
    finally:
        resident.close()
    streamed = Engine.load(ref.out_dir, store=StoreOptions(mode="tiered", cache=1))
    try:
        got, done = _run(streamed, prompt, params, SpecSettings("ngram", 4))
        assert got == want
        assert streamed.experts.statistics().bytes_read > 0
    finally:
        streamed.close()
