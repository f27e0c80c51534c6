"""PILOT decides for itself, per run, whether it pays: measured decode token times with
and without it, not a rule.

Why measured: PILOT overlaps the drive with compute, but its slots are slots the cache
does not get and its wrong guesses spend disk time. Which wins depends on the drive, the
compute rate, the routing skew and the budget: on a GLM-5-shaped model streamed at 3x
the budget one plan measured PILOT 1.7x faster, an earlier plan with more PILOT slots
measured it slower at two budgets. So with ``--pilot auto`` the store tries both.

Off means PILOT's slots are lent to the caches (one more expert per layer for every
layer's worth of slots; what is left over stays free) and hints read nothing, but the
predictions are still scored, so the recall stays measured either way. Placement never
changes tokens, so switching cannot either.

Schedule (decode tokens only: a prefill pass is many tokens and reads differently):
windows of WINDOW tokens, the first WARMUP after a switch not counted (the slots that
moved are refilling); trial windows alternate until each state has TRIALS; then the
faster state (the current one unless the other is faster by more than MARGIN) holds for
HOLD windows, and one window of the other state re-measures it. A gap of more than CLEAR
after one window of each ends the trials at once: on a 10.7 GB GLM-5-shaped model at 3x
the budget PILOT measured 463 against 574 ms a token, and the second pair of trial
windows cost ~40 tokens at the slow state for nothing. Each state's figure is the average
of its last windows (half old, half new), so a drift is followed.

With a memory (store/pilot_memory.py), what earlier runs of the same model and plan
measured counts as trials already done: both states remembered, the run starts in the
faster one and goes straight to holding it; one remembered, it measures the other state
first and decides after that one window. Every window measured, in any mode (a fixed
`on` or `off` run measures without switching), updates the memory.
"""

from __future__ import annotations

from colibrid.store.pilot_memory import PilotMemory

WINDOW = 16
WARMUP = 4
TRIALS = 2
HOLD = 8
MARGIN = 0.03
CLEAR = 0.20  # one window each decides past this gap; a wrong call is re-measured after HOLD


class PilotSwitch:
    """``fixed``: a `--pilot on` or `off` run, which measures its state for the memory and
    never switches; ``memory``: what earlier runs measured, and where this one's go."""

    def __init__(self, memory: PilotMemory | None = None, fixed: bool | None = None) -> None:
        self.on = True if fixed is None else fixed
        self.fixed = fixed
        self.memory = memory
        self.seconds: dict[bool, float | None] = {True: None, False: None}  # per token
        self.windows = {True: 0, False: 0}
        self._since_switch = 0
        self._wall = 0.0
        self._tokens = 0
        self._held = 0
        self.switches = 0
        self.remembered = memory.load() if memory is not None and fixed is None else {}
        for state, seconds in self.remembered.items():
            self.seconds[state] = seconds
            self.windows[state] = TRIALS  # an earlier run's measurement: a trial done
        if len(self.remembered) == 2:  # start in the faster state (PILOT on within MARGIN)
            self.on = self.remembered[False] * (1.0 + MARGIN) >= self.remembered[True]
        elif self.remembered:  # measure the state not remembered first
            self.on = not next(iter(self.remembered))

    def observe(self, rows: int, wall_s: float) -> bool:
        """A forward pass of ``rows`` tokens took ``wall_s``; returns whether PILOT should
        be on for the next pass."""
        if rows != 1:
            return self.on
        self._since_switch += 1
        if self._since_switch <= WARMUP:
            return self.on
        self._wall += wall_s
        self._tokens += 1
        if self._tokens < WINDOW:
            return self.on
        mean = self._wall / self._tokens
        self._wall, self._tokens = 0.0, 0
        old = self.seconds[self.on]
        self.seconds[self.on] = mean if old is None else 0.5 * (old + mean)
        self.windows[self.on] += 1
        if self.memory is not None:
            self.memory.save(self.on, self.seconds[self.on] or mean)
        if self.fixed is not None:
            return self.on
        return self._decide()

    def _decide(self) -> bool:
        if not self.trials_over:
            return self._switch()
        here, there = self.seconds[self.on], self.seconds[not self.on]
        assert here is not None and there is not None  # both measured: the trials are over
        if there * (1.0 + MARGIN) < here:
            self._held = 0
            return self._switch()
        if self._held >= HOLD:  # held long enough: re-measure the other state for a window
            self._held = 0
            return self._switch()
        self._held += 1
        return self.on

    @property
    def trials_over(self) -> bool:
        """Each state had its TRIALS windows, or one beat the other by more than CLEAR."""
        with_, without = self.seconds[True], self.seconds[False]
        if with_ is None or without is None:
            return False
        if min(self.windows.values()) >= TRIALS:
            return True
        return max(with_, without) > min(with_, without) * (1.0 + CLEAR)

    def _switch(self) -> bool:
        self.on = not self.on
        self._since_switch = 0
        self._wall, self._tokens = 0.0, 0
        self.switches += 1
        return self.on

    def describe(self) -> str:
        with_, without = self.seconds[True], self.seconds[False]
        state = "on" if self.on else "off"
        if self.fixed is not None:
            return state
        if with_ is None or without is None:
            return f"auto: {state}, measuring"
        figures = f"{with_ * 1e3:.0f} ms/token with PILOT, {without * 1e3:.0f} without"
        if not self.trials_over:  # still alternating: nothing chosen yet
            return f"auto: {state}, measuring ({figures} so far)"
        earlier = f"; {len(self.remembered)} state(s) remembered" if self.remembered else ""
        return f"auto: {state} ({figures}; {self.switches} switches{earlier})"
