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
HOLD windows, and one window of the other state re-measures it. Each state's figure is
the average of its last windows (half old, half new), so a drift is followed.
"""

from __future__ import annotations

WINDOW = 16
WARMUP = 4
TRIALS = 2
HOLD = 8
MARGIN = 0.03


class PilotSwitch:
    def __init__(self) -> None:
        self.on = True
        self.seconds: dict[bool, float | None] = {True: None, False: None}  # per token
        self.windows = {True: 0, False: 0}
        self._since_switch = 0
        self._wall = 0.0
        self._tokens = 0
        self._held = 0
        self.switches = 0

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
        return self._decide()

    def _decide(self) -> bool:
        here, there = self.seconds[self.on], self.seconds[not self.on]
        if min(self.windows.values()) < TRIALS or here is None or there is None:
            return self._switch()
        if there * (1.0 + MARGIN) < here:
            self._held = 0
            return self._switch()
        if self._held >= HOLD:  # held long enough: re-measure the other state for a window
            self._held = 0
            return self._switch()
        self._held += 1
        return self.on

    def _switch(self) -> bool:
        self.on = not self.on
        self._since_switch = 0
        self._wall, self._tokens = 0.0, 0
        self.switches += 1
        return self.on

    def describe(self) -> str:
        with_, without = self.seconds[True], self.seconds[False]
        state = "on" if self.on else "off"
        if with_ is None or without is None:
            return f"auto: {state}, measuring"
        figures = f"{with_ * 1e3:.0f} ms/token with PILOT, {without * 1e3:.0f} without"
        if min(self.windows.values()) < TRIALS:  # still alternating: nothing chosen yet
            return f"auto: {state}, measuring ({figures} so far)"
        return f"auto: {state} ({figures}; {self.switches} switches)"
