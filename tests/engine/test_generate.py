"""The generation loop against a small deterministic fake engine."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from colibrid.engine.generate import (
    DoneEvent,
    GenStats,
    TokenEvent,
    generate,
    teacher_forced_argmax,
)
from colibrid.engine.sampling import NonFiniteLogits, SamplingError, SamplingParams
from colibrid.engine.text_out import StopStringMatcher
from colibrid.engine.tokenizer import StreamingDetokenizer, TextCodec
from colibrid.errors import RequestError


# ---- fakes ------------------------------------------------------------------------------
class FakeSession:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.ids: list[int] = []

    def _logits(self) -> np.ndarray:
        return self.engine.logits_for(self.ids)

    def prefill(
        self, token_ids: Sequence[int], *, all_logits: bool = False, cancel=None, progress=None
    ) -> np.ndarray:
        self.engine.prefills += 1
        rows = []
        for t in token_ids:
            self.ids.append(t)
            rows.append(self._logits())
        assert self.length <= self.engine.max_context
        return np.stack(rows) if all_logits else rows[-1]

    def decode(self, token_id: int, *, cancel=None) -> np.ndarray:
        self.engine.decodes += 1
        self.ids.append(token_id)
        assert self.length <= self.engine.max_context
        return self._logits()

    @property
    def length(self) -> int:
        return len(self.ids)

    def common_prefix(self, token_ids: Sequence[int]) -> int:
        n = 0
        for a, b in zip(self.ids, token_ids, strict=False):
            if a != b:
                break
            n += 1
        return n

    def truncate(self, length: int) -> None:
        del self.ids[length:]

    def remember_logits(self, length: int, logits: np.ndarray) -> None:
        self.remembered = (length, logits)

    def logits_at(self, length: int) -> np.ndarray | None:
        kept = getattr(self, "remembered", None)
        return kept[1] if kept is not None and kept[0] == length <= self.length else None


class FakeEngine:
    """Next-token logits are a pure function of the context, so runs are reproducible."""

    def __init__(
        self,
        next_logits: Callable[[list[int]], np.ndarray],
        vocab_size: int,
        max_context: int = 4096,
    ) -> None:
        self.logits_for = lambda ids: next_logits(list(ids)).astype(np.float32)
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.mtp_on = False
        self.prefills = self.decodes = 0

    def new_session(self) -> FakeSession:
        return FakeSession(self)

    def request_finished(self) -> None:
        pass  # no store here: nothing to save or re-pin

    @classmethod
    def scripted(cls, prompt_len: int, script: Sequence[int], vocab_size: int, **kw) -> FakeEngine:
        """Greedy output is exactly `script` (then token 0 forever)."""

        def next_logits(ids: list[int]) -> np.ndarray:
            out = np.zeros(vocab_size)
            pos = len(ids) - prompt_len
            out[script[pos] if 0 <= pos < len(script) else 0] = 10.0
            return out

        return cls(next_logits, vocab_size, **kw)

    @classmethod
    def random(cls, vocab_size: int, **kw) -> FakeEngine:
        def next_logits(ids: list[int]) -> np.ndarray:
            seed = hash(tuple(ids)) & 0xFFFFFFFF
            return np.random.default_rng(seed).standard_normal(vocab_size) * 3

        return cls(next_logits, vocab_size, **kw)


def byte_codec() -> TextCodec:
    """Byte-level BPE without merges: every byte is a token, so most non-ASCII characters
    span several tokens. Id 256 is the end-of-sequence token."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return TextCodec(tok, stop_token_ids=frozenset({256}))


CODEC = byte_codec()
EOS = 256
PROMPT = CODEC.encode("Q:", add_special_tokens=False)


def run(engine, params, *, prompt=PROMPT, stops=frozenset({EOS}), detok=True, cancel=None):
    events = list(
        generate(
            engine,
            prompt,
            params,
            stop_token_ids=stops,
            cancel=cancel,
            detokenizer=StreamingDetokenizer(CODEC) if detok else None,
        )
    )
    assert isinstance(events[-1], DoneEvent)
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[:-1], events[-1]


def script_for(text: str, tail: Sequence[int] = ()) -> list[int]:
    return CODEC.encode(text, add_special_tokens=False) + list(tail)


def text_of(tokens: list[TokenEvent]) -> str:
    return "".join(e.text for e in tokens)


# ---- tests ------------------------------------------------------------------------------
def test_length_finish_and_utf8_never_broken():
    text = "Héllo 🙂 wörld 日本 👩‍💻"
    script = script_for(text)
    engine = FakeEngine.scripted(len(PROMPT), script, 257)
    tokens, done = run(engine, SamplingParams(max_tokens=len(script)))
    assert [e.token_id for e in tokens] == script
    assert text_of(tokens) == text
    assert not any("\ufffd" in e.text for e in tokens)
    assert done.finish_reason == "length"
    assert done.stats.prompt_tokens == len(PROMPT)
    assert done.stats.generated_tokens == len(script)
    assert (engine.prefills, engine.decodes) == (1, len(script) - 1)


def test_stop_token_ends_without_its_text():
    script = script_for("ok", [EOS]) + script_for("never")
    tokens, done = run(FakeEngine.scripted(len(PROMPT), script, 257), SamplingParams())
    assert [e.token_id for e in tokens] == script[:3]
    assert tokens[-1].text == "" and text_of(tokens) == "ok"
    assert done.finish_reason == "stop" and done.stats.generated_tokens == 3


def test_stop_token_releases_held_text():
    # "ST" could start the stop string "STOP"; the stop token releases it.
    script = script_for("aST", [EOS])
    tokens, done = run(
        FakeEngine.scripted(len(PROMPT), script, 257), SamplingParams(stop=("STOP",))
    )
    assert [e.text for e in tokens] == ["a", "", "", "ST"]
    assert done.finish_reason == "stop"


@pytest.mark.parametrize(
    "text, stops, out",
    [
        ("abc STOP def", ("STOP",), "abc "),
        ("abc STOP def", ("xyz", "OP d", "C"), "abc ST"),
        ("smile 🙂 then", ("🙂",), "smile "),
        ("日本語です", ("語で",), "日本"),
        ("STSTOP", ("STOP",), "ST"),
        (" aa", ("a", " aa"), " "),
        ("xba", ("a", "ba"), "x"),
        ("no stop here", ("stop!",), "no stop here"),
    ],
)
def test_stop_strings_across_token_boundaries(text, stops, out):
    script = script_for(text)
    tokens, done = run(
        FakeEngine.scripted(len(PROMPT), script, 257),
        SamplingParams(max_tokens=len(script), stop=stops),
    )
    assert text_of(tokens) == out
    assert done.finish_reason == ("length" if out == text else "stop")
    assert not any("\ufffd" in e.text for e in tokens)


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(st.sampled_from(list("ab é日🙂\n")), max_size=24),
    stops=st.lists(
        st.text(st.sampled_from(list("ab é日🙂\n")), min_size=1, max_size=3), min_size=1, max_size=3
    ),
)
def test_stop_strings_property(text, stops):
    script = script_for(text, [EOS])
    tokens, done = run(
        FakeEngine.scripted(len(PROMPT), script, 257), SamplingParams(stop=tuple(stops))
    )
    # the stop string that completes first cuts the text, whatever the token boundaries
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    assert text_of(tokens) == (text[: min(hits)[1]] if hits else text)
    assert done.finish_reason == "stop"


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(st.sampled_from(list("abc日")), max_size=20),
    stops=st.lists(
        st.text(st.sampled_from(list("abc日")), min_size=1, max_size=4), min_size=1, max_size=4
    ),
    cuts=st.lists(st.integers(0, 20), max_size=6),
)
def test_stop_matcher_ignores_how_text_is_split(text, stops, cuts):
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    matcher, out, hit = StopStringMatcher(stops), "", False
    for n, piece in enumerate(pieces):
        released, hit = matcher.feed(piece, final=n == len(pieces) - 1)
        out += released
        if hit:
            break
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    assert (out, hit) == ((text[: min(hits)[1]], True) if hits else (text, False))


def test_max_tokens_counts_and_stop_string_on_last_token():
    script = script_for("abcdef")
    tokens, done = run(FakeEngine.scripted(len(PROMPT), script, 257), SamplingParams(max_tokens=4))
    assert text_of(tokens) == "abcd" and done.finish_reason == "length"
    tokens, done = run(
        FakeEngine.scripted(len(PROMPT), script, 257), SamplingParams(max_tokens=4, stop=("cd",))
    )
    assert text_of(tokens) == "ab" and done.finish_reason == "stop"


def test_cancel_between_tokens():
    engine = FakeEngine.scripted(len(PROMPT), script_for("abcdefgh"), 257)
    cancel = threading.Event()
    seen = []
    for event in generate(engine, PROMPT, SamplingParams(), cancel=cancel):
        seen.append(event)
        if len(seen) == 3:
            cancel.set()
    assert len(seen) == 4 and seen[-1].finish_reason == "cancelled"
    assert seen[-1].stats.generated_tokens == 3 and engine.decodes == 2


def test_cancel_before_start_skips_prefill():
    engine = FakeEngine.random(257)
    cancel = threading.Event()
    cancel.set()
    tokens, done = run(engine, SamplingParams(), cancel=cancel)
    assert tokens == [] and done.finish_reason == "cancelled" and engine.prefills == 0


def test_seed_determinism():
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=42)
    a, _ = run(FakeEngine.random(257), params, stops=frozenset())
    b, _ = run(FakeEngine.random(257), params, stops=frozenset())
    c, _ = run(
        FakeEngine.random(257),
        SamplingParams(max_tokens=30, temperature=0.8, seed=43),
        stops=frozenset(),
    )
    assert a == b and [e.token_id for e in a] != [e.token_id for e in c]


def test_context_overflow_is_refused_with_numbers():
    engine = FakeEngine.random(257, max_context=8)
    with pytest.raises(RequestError, match="8 tokens but the context holds 8"):
        generate(engine, list(range(8)), SamplingParams())
    with pytest.raises(RequestError, match="9 tokens"):
        generate(engine, list(range(9)), SamplingParams())


def test_max_tokens_clamped_to_room_left():
    engine = FakeEngine.random(257, max_context=8)
    tokens, done = run(
        engine,
        SamplingParams(max_tokens=100),
        prompt=[1, 2, 3, 4, 5],
        stops=frozenset(),
        detok=False,
    )
    assert len(tokens) == 3 and done.finish_reason == "length"
    assert all(e.text == "" for e in tokens)


def test_bad_requests_fail_before_any_work():
    engine = FakeEngine.random(257)
    with pytest.raises(RequestError, match="empty prompt"):
        generate(engine, [], SamplingParams())
    with pytest.raises(RequestError, match="token id 999 is outside"):
        generate(engine, [1, 999], SamplingParams())
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        generate(engine, [1], SamplingParams(stop=("x",)))
    assert engine.prefills == 0


def test_non_finite_logits_surface():
    engine = FakeEngine(lambda ids: np.full(4, np.nan), 4)
    with pytest.raises(SamplingError, match="non-finite"):
        list(generate(engine, [1], SamplingParams()))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", [0, 2], ids=["first-token", "later-token"])
def test_a_non_finite_model_row_fails_the_request_before_sampling(bad, where):
    """One bad logit anywhere in the model's row (even -inf, which a grammar's mask may
    write but a model never should) fails the request with INTERNAL and says where; the
    tokens before it were sampled from finite rows."""

    def next_logits(ids: list[int]) -> np.ndarray:
        out = np.arange(8, dtype=np.float64)
        if len(ids) - 1 == where:
            out[3] = bad
        return out

    events = []
    with pytest.raises(NonFiniteLogits, match=f"generated token {where} ") as info:
        for event in generate(FakeEngine(next_logits, 8), [1], SamplingParams(max_tokens=6)):
            events.append(event)
    assert info.value.code == "INTERNAL" and "inspect --verify" in str(info.value)
    assert [e.token_id for e in events] == [7] * where


def test_teacher_forced_argmax():
    engine = FakeEngine.random(50)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    expect = [int(np.argmax(engine.logits_for(ids[: i + 1]))) for i in range(len(ids))]
    assert teacher_forced_argmax(engine, ids) == expect
    assert (engine.prefills, engine.decodes) == (1, 0)
    with pytest.raises(RequestError):
        teacher_forced_argmax(engine, [])


def test_stats_line():
    stats = GenStats.measure(12, 21, 0.5, 2.0)
    assert stats.prefill_tok_s == 24.0 and stats.decode_tok_s == 10.0
    assert stats.as_line() == (
        "12 prompt + 21 generated tokens, prefill 24.0 tok/s, decode 10.0 tok/s"
    )
    assert "decode 2.000 s" in stats.as_line(verbose=True)
    assert GenStats.measure(1, 1, 0.0, 0.0).decode_tok_s == 0.0
    # only computed prompt tokens count: 3 of 12 in 0.5 s, none at all for a cached prompt
    assert GenStats.measure(12, 21, 0.5, 2.0, computed=3).prefill_tok_s == 6.0
    assert GenStats.measure(12, 21, 1e-6, 2.0, computed=0).prefill_tok_s == 0.0
