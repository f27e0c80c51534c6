"""Rows are independent (engine.batch): a row's logits depend on its token, its position and
the KV before it, never on what shares its pass — bit for bit, on every architecture and
kernel family. That is what makes batched decode and speculative verify exact."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.backends.base import KernelFamily
from colibrid.engine import batch
from colibrid.engine.batch import LOGITS_ALL, LOGITS_LAST, LOGITS_NONE, Forward
from colibrid.engine.engine import Engine
from colibrid.errors import RequestError
from colibrid.store.options import StoreOptions

ARCHS = (
    "glm4_moe",
    "deepseek_v3",
    "glm_moe_dsa",
    "deepseek_v32",
    "qwen3_moe",
    "mixtral",
    "olmoe",
    "gpt_oss",
)
FAMILIES = (KernelFamily.F32, KernelFamily.I8)


def bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module", params=[(a, f) for a in ARCHS for f in FAMILIES], ids=str)
def engine(request, oracle_checkpoint):
    arch, family = request.param
    eng = Engine.load(
        oracle_checkpoint(arch).out_dir, family=family, store=StoreOptions(mode="resident")
    )
    yield eng
    eng.close()


def ids(engine, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, engine.vocab_size, n)]


def test_a_verify_of_many_rows_equals_one_token_decodes(engine) -> None:
    """Past the DSA budget (index_topk 8) so the indexer really selects per row."""
    prompt, cont = ids(engine, 30, 1), ids(engine, 7, 2)
    one = engine.new_session()
    one.prefill(prompt)
    singles = [one.decode(t) for t in cont]
    many = engine.new_session()
    many.prefill(prompt)
    rows = many.prefill(cont, all_logits=True)
    for k, single in enumerate(singles):
        assert np.array_equal(bits(rows[k]), bits(single)), f"row {k} differs"


def test_a_prompt_in_chunks_equals_the_prompt_at_once(engine) -> None:
    prompt = ids(engine, 41, 3)
    whole = engine.new_session().prefill(prompt, all_logits=True)
    session = engine.new_session()
    parts = [session.prefill(prompt[i : i + 9], all_logits=True) for i in range(0, 41, 9)]
    assert np.array_equal(bits(np.concatenate(parts)), bits(whole))


def test_sessions_sharing_a_pass_get_their_own_logits(engine) -> None:
    """A decode, a verify, a prompt chunk and a whole prompt in one pass: each equals the
    same rows run alone, and each session then holds exactly its own rows."""
    alone, shared = [], []
    plans = [  # (prompt, then rows of the shared pass, logits wanted)
        (ids(engine, 12, 4), ids(engine, 1, 5), LOGITS_LAST),
        (ids(engine, 20, 6), ids(engine, 5, 7), LOGITS_ALL),
        (ids(engine, 3, 8), ids(engine, 16, 9), LOGITS_NONE),
        ([], ids(engine, 11, 10), LOGITS_LAST),
    ]
    for prompt, rows, mode in plans:
        session = engine.new_session()
        if prompt:
            session.prefill(prompt)
        want = session.prefill(rows, all_logits=mode == LOGITS_ALL)
        alone.append((session, None if mode == LOGITS_NONE else want))
    sessions = []
    for prompt, _rows, _mode in plans:
        session = engine.new_session()
        if prompt:
            session.prefill(prompt)
        sessions.append(session)
    forwards = [
        Forward.of(session, rows, mode)
        for session, (_p, rows, mode) in zip(sessions, plans, strict=True)
    ]
    shared = batch.run(engine, forwards)
    for k, ((mine, want), got, session) in enumerate(zip(alone, shared, sessions, strict=True)):
        assert session.tokens == mine.tokens and session.length == mine.length, k
        if want is None:
            assert got is None
        else:
            assert np.array_equal(bits(got), bits(want)), f"forward {k} differs"
    # and the next step of each still matches: the shared pass wrote the right KV rows
    nxt = ids(engine, 1, 11)
    for session, (mine, _want) in zip(sessions, alone, strict=True):
        assert np.array_equal(bits(session.decode(nxt[0])), bits(mine.decode(nxt[0])))


def test_a_pass_that_fails_commits_nothing(engine) -> None:
    a, b = engine.new_session(), engine.new_session()
    a.prefill(ids(engine, 5, 12))
    b.prefill(ids(engine, 7, 13))
    held = (a.length, list(a.tokens), b.length, list(b.tokens))

    def boom(layer: int) -> None:
        if layer == 1:
            raise RuntimeError("injected")

    forwards = [Forward.of(a, ids(engine, 2, 14)), Forward.of(b, ids(engine, 1, 15))]
    with pytest.raises(RuntimeError, match="injected"):
        batch.run(engine, forwards, boom)
    assert (a.length, a.tokens, b.length, b.tokens) == held
    with pytest.raises(ValueError, match="once"):
        batch.run(engine, [Forward.of(a, [1]), Forward.of(a, [2])])
    with pytest.raises(RequestError):
        Forward.of(a, [engine.vocab_size])  # refused before any pass
