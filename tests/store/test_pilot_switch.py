"""PILOT's self-switch (store/pilot_switch.py): it tries both states, keeps the faster,
re-measures the other now and then, counts only decode tokens; and in the store,
switching lends PILOT's slots to the caches and back without changing a token."""

from __future__ import annotations

import json

import pytest

from colibrid.engine.engine import Engine
from colibrid.engine.generate import TokenEvent, generate
from colibrid.engine.sampling import SamplingParams
from colibrid.store import pilot_switch
from colibrid.store.options import StoreOptions
from colibrid.store.pilot_memory import MAX_ENTRIES, PilotMemory
from colibrid.store.pilot_switch import CLEAR, HOLD, MARGIN, TRIALS, WARMUP, WINDOW, PilotSwitch


def feed(switch: PilotSwitch, seconds: dict[bool, float], windows: int) -> list[bool]:
    """Decode tokens costing seconds[state] each; the state at the end of each window."""
    states = []
    for _ in range(windows):
        done = sum(switch.windows.values())
        for _ in range(WARMUP + WINDOW):
            switch.observe(1, seconds[switch.on])
            if sum(switch.windows.values()) > done:
                break
        assert sum(switch.windows.values()) == done + 1
        states.append(switch.on)
    return states


CLOSE = {True: 0.22, False: 0.20}  # PILOT 10% slower: past the margin, not clear at once
assert MARGIN < 0.22 / 0.20 - 1 < CLEAR


def test_trials_alternate_then_the_faster_state_holds():
    switch = PilotSwitch()
    assert switch.on and "measuring" in switch.describe()
    states = feed(switch, CLOSE, 2 * TRIALS - 1)
    # both states measured, not both enough: the state it is in is not a choice yet
    assert "measuring (220 ms/token with PILOT, 200 without so far)" in switch.describe()
    states += feed(switch, CLOSE, 1)
    assert states[: 2 * TRIALS - 1] == [i % 2 == 1 for i in range(2 * TRIALS - 1)]
    assert switch.on is False, "PILOT costs more than it saves here: off"
    held = feed(switch, CLOSE, HOLD - 1)
    assert held == [False] * (HOLD - 1)
    assert "off (220 ms/token with PILOT, 200 without" in switch.describe()


@pytest.mark.parametrize("pilot_wins", [True, False])
def test_a_clear_gap_ends_the_trials_after_one_window_each(pilot_wins: bool):
    """463 against 574 ms a token (measured on a GLM-5-shaped model at 3x the budget):
    the faster state holds from the second window on, the first decided one included."""
    seconds = {True: 0.463, False: 0.574} if pilot_wins else {True: 0.574, False: 0.463}
    switch = PilotSwitch()
    states = feed(switch, seconds, 2 + HOLD - 1)
    assert states[0] is False  # the first window was PILOT on: now the other state
    assert states[1:] == [pilot_wins] * HOLD
    assert switch.switches == (1 if not pilot_wins else 2)
    assert "measuring" not in switch.describe()


def test_the_other_state_is_re_measured_and_a_change_is_followed():
    switch = PilotSwitch()
    feed(switch, CLOSE, 2 * TRIALS + HOLD - 1)
    assert switch.on is False
    feed(switch, CLOSE, 1)  # HOLD reached: one window of PILOT on
    assert switch.on is True
    feed(switch, {True: 0.10, False: 0.20}, 1)  # PILOT got better: it stays on
    assert switch.on is True
    feed(switch, {True: 0.10, False: 0.20}, 3)
    assert switch.on is True


def test_within_the_margin_the_current_state_stays():
    switch = PilotSwitch()
    feed(switch, {True: 0.200, False: 0.202}, 2 * TRIALS)
    state = switch.on
    assert feed(switch, {True: 0.200, False: 0.202}, HOLD - 1) == [state] * (HOLD - 1)


def test_prefill_passes_and_warm_up_tokens_are_not_counted():
    switch = PilotSwitch()
    for _ in range(1000):
        switch.observe(32, 5.0)
    assert switch.on and switch.windows == {True: 0, False: 0}
    for _ in range(WARMUP + WINDOW - 1):
        switch.observe(1, 0.1)
    assert switch.on, "one token short of a window"
    switch.observe(1, 0.1)
    assert not switch.on and switch.windows[True] == 1


def test_switching_lends_slots_and_never_changes_tokens(oracle_checkpoint, monkeypatch):
    """--pilot auto with a switch every two decode tokens: PILOT's slots move to the caches
    and back many times in one answer, the text equals the resident run's and the
    bookkeeping stays whole."""
    monkeypatch.setattr(pilot_switch, "WINDOW", 2)
    monkeypatch.setattr(pilot_switch, "WARMUP", 0)
    monkeypatch.setattr(pilot_switch, "TRIALS", 10_000)  # never leaves the trial phase,
    monkeypatch.setattr(pilot_switch, "CLEAR", float("inf"))  # not even on a wide gap
    ref = oracle_checkpoint("glm4_moe")
    opts = StoreOptions(mode="tiered", cache=1, pin="off", pilot="auto", io_threads=2)
    engine = Engine.load(ref.out_dir, store=opts)
    try:
        store = engine.experts
        assert store.pilot_switch is not None and store.streams()
        plan = store.plan
        per_layer = plan.pilot // store.n_layers
        assert per_layer >= 1, "the tiny model must have a layer's worth of PILOT slots"
        lent = []
        real_set = store.set_pilot

        def recording(on: bool) -> None:
            real_set(on)
            lent.append(store.placement.lent)
            assert store.cache_max == plan.cache_per_layer + store.placement.lent
            store.check_consistency()

        monkeypatch.setattr(store, "set_pilot", recording)
        params = SamplingParams(max_tokens=20, temperature=0.0)
        events = generate(engine, ref.prompt_ids, params)
        tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
        assert tokens == ref.greedy_ids
        assert per_layer in lent and 0 in lent, f"slots never moved both ways: {lent}"
        st = store.statistics()
        assert st.pilot_recall is not None, "guesses are scored in both states"
        assert st.pilot_note.startswith("auto: ")
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["on", "off"])
def test_explicit_pilot_modes_do_not_switch(oracle_checkpoint, mode):
    ref = oracle_checkpoint("glm4_moe")
    opts = StoreOptions(mode="tiered", cache=1, pin="off", pilot=mode, io_threads=2)
    engine = Engine.load(ref.out_dir, store=opts)
    try:
        assert engine.experts.pilot_switch is None
        assert engine.experts.statistics().pilot_note == mode
    finally:
        engine.close()


# ---- what earlier runs measured (store/pilot_memory.py) ---------------------------------
def test_both_states_remembered_start_in_the_faster_one_without_trials(tmp_path):
    memory = PilotMemory(tmp_path / "pilot.json", "model|plan")
    memory.save(True, 0.22)  # written at once (the first write)
    memory.save(False, 0.20)  # pending: a write a minute at most while decoding
    assert PilotMemory(memory.path, memory.key).load() == {True: pytest.approx(0.22)}
    memory.flush()
    switch = PilotSwitch(memory)
    assert switch.on is False and switch.trials_over
    assert feed(switch, CLOSE, HOLD - 1) == [False] * (HOLD - 1), "no trial at the slow state"
    assert "2 state(s) remembered" in switch.describe()
    assert memory.load()[False] == pytest.approx(0.20)


def test_one_state_remembered_measures_the_other_then_decides(tmp_path):
    memory = PilotMemory(tmp_path / "pilot.json", "model|plan")
    memory.save(True, 0.463)  # a `--pilot on` run measured this
    switch = PilotSwitch(memory)
    assert switch.on is False, "the state nobody measured yet goes first"
    states = feed(switch, {True: 0.463, False: 0.574}, 1 + HOLD - 1)
    assert states == [True] * HOLD, "one window of the other state decided it"


def test_fixed_runs_measure_for_the_memory_and_never_switch(tmp_path):
    memory = PilotMemory(tmp_path / "pilot.json", "k")
    fixed = PilotSwitch(memory, fixed=False)
    assert feed(fixed, {True: 0.1, False: 0.3}, 3) == [False] * 3
    memory.flush()
    assert memory.load() == {False: pytest.approx(0.3)} and fixed.describe() == "off"


def test_the_memory_is_per_plan_bounded_and_survives_a_bad_file(tmp_path):
    path = tmp_path / "pilot.json"
    path.write_text("{not json")
    assert PilotMemory(path, "a").load() == {}
    for k in range(MAX_ENTRIES + 5):
        PilotMemory(path, f"plan{k}").save(True, 0.1 + k / 1000)
    assert PilotMemory(path, "plan0").load() == {}, "the oldest plans are forgotten"
    last = f"plan{MAX_ENTRIES + 4}"
    assert PilotMemory(path, last).load() == {True: pytest.approx(0.1 + (MAX_ENTRIES + 4) / 1000)}
    assert PilotMemory(path, "other").load() == {}
    assert (path.stat().st_mode & 0o777) == 0o600


def test_a_run_remembers_for_the_next_and_tokens_never_change(
    oracle_checkpoint, tmp_path, monkeypatch
):
    """`off`, then `on`, each measuring into the model's memory; then `auto` starts in the
    faster state without trials. Every run answers the resident run's tokens."""
    monkeypatch.setattr(pilot_switch, "WINDOW", 2)
    monkeypatch.setattr(pilot_switch, "WARMUP", 0)
    ref = oracle_checkpoint("glm4_moe")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    notes = {}
    for mode in ("off", "on", "auto"):
        opts = StoreOptions(mode="tiered", cache=1, pin="off", pilot=mode, io_threads=2,
                            profiles_dir=tmp_path)  # fmt: skip
        engine = Engine.load(ref.out_dir, store=opts)
        try:
            store = engine.experts
            assert store.pilot_switch is not None
            if mode == "auto":
                assert len(store.pilot_switch.remembered) == 2 and store.pilot_switch.trials_over
                assert store.pilot_on == store.pilot_switch.on
            events = generate(engine, ref.prompt_ids, params)
            assert [e.token_id for e in events if isinstance(e, TokenEvent)] == ref.greedy_ids[:12]
            notes[mode] = store.statistics().pilot_note
        finally:
            engine.close()
    saved = json.loads((tmp_path / ref.out_dir.name / "pilot.json").read_text())
    (entry,) = saved["entries"].values()
    assert entry["on_ms"] > 0 and entry["off_ms"] > 0
    assert notes["off"] == "off" and notes["on"] == "on"
    assert "remembered" in notes["auto"]
