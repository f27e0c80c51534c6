"""Kept sessions on a real tiny engine: the prompt cache reuses exactly the KV a request
shares with an earlier one, a copied prefix computes what the original would, a repeated
prompt repeats its answer bit for bit, and kept KV stays within its budget."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.engine.engine import Engine
from colibrid.engine.generate import DoneEvent, TokenEvent, generate, reusable_prefix
from colibrid.engine.sampling import SamplingParams
from colibrid.engine.sessions import TAKEOVER_SLACK, SessionPool
from colibrid.errors import RequestError

SYSTEM = list(range(5, 45))  # a shared "system prompt"


@pytest.fixture(scope="module", params=["glm4_moe", "glm_moe_dsa"])
def engine(request, oracle_checkpoint) -> Engine:
    eng = Engine.load(oracle_checkpoint(request.param).out_dir, max_context=512)
    yield eng
    eng.close()


def run(engine: Engine, session, ids: list[int], **params) -> tuple[list[int], DoneEvent]:
    events = list(
        generate(engine, ids, SamplingParams(**{"max_tokens": 6, **params}), session=session)
    )
    return [e.token_id for e in events if isinstance(e, TokenEvent)], events[-1]


def test_fork_copies_exactly_the_shared_kv(engine: Engine) -> None:
    original = engine.new_session()
    original.prefill(SYSTEM + [50, 51, 52])
    copy = original.fork(len(SYSTEM))
    assert copy.tokens == SYSTEM and copy.length == len(SYSTEM)
    assert original.length == len(SYSTEM) + 3  # the original is left as it was
    # the same continuation from the copy and from the original (cut back) is bit-identical
    from_copy = copy.prefill([60, 61])
    original.truncate(len(SYSTEM))
    assert np.array_equal(from_copy, original.prefill([60, 61]))


def test_repeated_prompt_repeats_exactly_without_prefill(engine: Engine) -> None:
    pool = SessionPool(engine.new_session, max_sessions=4)
    ids = SYSTEM + [70, 71]
    key, session = pool.checkout(1, None, ids)
    first, _ = run(engine, session, ids, temperature=1.0, seed=7)
    pool.checkin(key)
    key, session = pool.checkout(1, None, ids)
    assert reusable_prefix(session, ids) == len(ids)  # nothing to prefill
    held = session.length
    again, done = run(engine, session, ids, temperature=1.0, seed=7)
    assert again == first
    assert done.stats.prefill_s < 0.01 and session.length == held - len(first) + len(again)


def test_next_turn_takes_the_session_over(engine: Engine) -> None:
    pool = SessionPool(engine.new_session, max_sessions=4)
    turn1 = SYSTEM + [80, 81]
    key1, s1 = pool.checkout(1, None, turn1)
    answer, _ = run(engine, s1, turn1)
    pool.checkin(key1)
    # the next turn resends turn 1 and its answer: it continues the same session
    turn2 = turn1 + answer + [90]
    key2, s2 = pool.checkout(2, None, turn2)
    assert s2 is s1 and reusable_prefix(s2, turn2) == len(turn1) + len(answer) - 1
    again, _ = run(engine, s2, turn2)
    pool.checkin(key2)
    assert len(pool) == 1 and s1.tokens[: len(turn2)] == turn2


def test_long_tail_is_copied_not_taken_over(engine: Engine) -> None:
    pool = SessionPool(engine.new_session, max_sessions=4)
    long = SYSTEM + list(range(100, 100 + TAKEOVER_SLACK + 10))
    key, s = pool.checkout(1, None, long)
    s.prefill(long)
    pool.checkin(key)
    key2, s2 = pool.checkout(1, None, SYSTEM + [7])
    assert s2 is not s and s2.tokens == SYSTEM and s.tokens == long
    pool.checkin(key2)
    assert len(pool) == 2


def test_named_conversations_busy_and_forgotten(engine: Engine) -> None:
    pool = SessionPool(engine.new_session, max_sessions=4)
    key, s = pool.checkout(1, "chat", [5, 6])
    with pytest.raises(RequestError) as err:
        pool.checkout(1, "chat", [5, 6])
    assert err.value.code == "CONV_BUSY"
    s.prefill([5, 6])
    pool.forget_client(1)  # the connection closed while its request ran
    pool.checkin(key)
    assert len(pool) == 0
    key, s = pool.checkout(2, "chat", [5, 6])
    assert s.length == 0  # a new client's conversation of the same name starts afresh


def test_kept_kv_stays_within_budget_and_can_be_off(engine: Engine) -> None:
    one = engine.new_session()
    one.prefill([5, 6])
    budget = one.kv_bytes()  # room for one kept session
    pool = SessionPool(engine.new_session, max_sessions=8, max_kv_bytes=budget)
    for i in range(3):
        key, s = pool.checkout(1, None, [200 + i, 7])
        s.prefill([200 + i, 7])
        pool.checkin(key)
        assert pool.kept_kv_bytes() <= budget and len(pool) == 1
    key, s = pool.checkout(1, None, [202, 7, 8])  # the newest is the one kept
    assert reusable_prefix(s, [202, 7, 8]) == 2
    pool.checkin(key)
    off = SessionPool(engine.new_session, max_sessions=8, prompt_cache=False)
    key, s = off.checkout(1, None, [5, 6])
    s.prefill([5, 6])
    off.checkin(key)
    assert len(off) == 0
    key, s = off.checkout(1, "named", [5, 6])
    s.prefill([5, 6])
    off.checkin(key)
    assert len(off) == 1  # named conversations are kept either way


def test_saved_prompt_cache_comes_back_exactly_for_the_same_engine_only(
    engine: Engine, oracle_checkpoint, tmp_path
) -> None:
    from colibrid.backends.base import KernelFamily
    from colibrid.engine import kv_files

    pool = SessionPool(engine.new_session, max_sessions=4)
    ids = SYSTEM + [70, 71]
    key, session = pool.checkout(1, None, ids)
    first, _ = run(engine, session, ids, temperature=1.0, seed=3)
    pool.checkin(key)
    assert kv_files.save(pool.cached_prompts(), tmp_path, engine) == 1
    (back,) = kv_files.load(tmp_path, engine)
    assert back.tokens == session.tokens
    assert reusable_prefix(back, ids) == len(ids)  # the prompt's logits came back too
    again, _ = run(engine, back, ids, temperature=1.0, seed=3)
    assert again == first
    # the same continuation from the saved and from the live KV: bit for bit
    session.truncate(len(ids))
    back.truncate(len(ids))
    assert np.array_equal(session.prefill([90, 91]), back.prefill([90, 91]))
    # another backend's f32 sums differ in their last bits: its engine refuses the file
    from colibrid.backends.cuda import CudaOps
    from colibrid.backends.cuda_device import EmulatedDevice

    cuda = Engine.load(engine.checkpoint.dir, max_context=512, ops=CudaOps(EmulatedDevice()))
    try:
        assert kv_files.load(tmp_path, cuda) == [] and not list(tmp_path.iterdir())
    finally:
        cuda.close()
    # another kernel family computed other KV: the file is refused and removed
    assert kv_files.save(pool.cached_prompts(), tmp_path, engine) == 1
    other = Engine.load(engine.checkpoint.dir, max_context=512, family=KernelFamily.I8)
    try:
        assert kv_files.load(tmp_path, other) == [] and not list(tmp_path.iterdir())
    finally:
        other.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "huge_member"])
def test_damaged_saved_kv_is_skipped_and_removed(engine: Engine, tmp_path, damage) -> None:
    import warnings
    import zipfile

    from colibrid.engine import kv_files

    session = engine.new_session()
    session.prefill(SYSTEM)
    kv_files.save([session], tmp_path, engine)
    path = tmp_path / "0.npz"
    if damage == "garbage":
        path.write_bytes(b"not a zip at all")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:  # a tokens member far larger than any context: refused before it is read
        with zipfile.ZipFile(path, "a") as z, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the later entry of the name is the one read
            z.writestr("tokens.npy", b"\0" * (8 * 512 + 8192))
    assert kv_files.load(tmp_path, engine) == []
    assert not path.exists()


def _snapshot(session) -> tuple[list[np.ndarray], dict[int, np.ndarray]]:
    cache = session.cache
    rows = [
        cache.read(layer, name, cache.length).copy()
        for layer, layout in enumerate(cache.layouts)
        for name in layout
    ]
    return rows, session.remembered_logits()


def test_verify_accepts_what_it_computed_and_leaves_it_untouched(engine: Engine) -> None:
    session = engine.new_session()
    ids = SYSTEM + [70, 71]
    run(engine, session, ids)  # prompt end remembered, a few generated tokens held
    before = _snapshot(session)
    assert session.verify() is None
    after = _snapshot(session)
    assert all(np.array_equal(a, b) for a, b in zip(before[0], after[0], strict=True))
    assert before[1].keys() == after[1].keys()
    assert all(np.array_equal(before[1][n], after[1][n]) for n in before[1])


def test_verify_catches_wrong_rows_and_wrong_logits(engine: Engine) -> None:
    session = engine.new_session()
    session.remember_logits(len(SYSTEM), session.prefill(SYSTEM))
    rows = session.cache.read(0, next(iter(session.cache.layouts[0])), session.length)
    rows[:] *= 1.5  # a wrong early layer: every later position computes differently
    assert "does not recompute" in (session.verify() or "")

    clean = engine.new_session()
    logits = clean.prefill(SYSTEM)
    clean.remember_logits(len(SYSTEM), logits + 0.5 * np.abs(logits).max())
    assert "logits" in (clean.verify() or "")


def test_restored_sessions_are_verified_before_first_use(engine: Engine) -> None:
    good, bad = engine.new_session(), engine.new_session()
    good.prefill(SYSTEM + [80])
    bad.prefill(SYSTEM + [90])
    rows = bad.cache.read(0, next(iter(bad.cache.layouts[0])), bad.length)
    rows[:] += 1.0
    pool = SessionPool(engine.new_session, max_sessions=4)
    pool.adopt([good, bad])
    _, taken = pool.checkout(1, None, SYSTEM + [90, 91])  # shares the most with `bad`
    assert taken is good  # `bad` failed its check and is gone; `good` continues
    assert len(pool) == 1
