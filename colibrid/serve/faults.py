"""The daemon's test hooks (config.toml `debug_layer_delay_s`, `debug_fail_prompt`,
`debug_fail_after`): a request's cancel flag that slows every check, or fails at its n-th
check. The engine host asks `FaultPlan.cancel_flag` for each request's flag; with no hook
set that is a plain `threading.Event`, so the hooks cost a request nothing unless a test
turns them on.

Why through the cancel flag: it is checked between layers and between tokens, so a delay
there makes prefill and decode slow enough to cancel mid-flight on a tiny model, and a
raise there is exactly what a failed read or a kernel bug does to a request inside a pass.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any


class InjectedFault(RuntimeError):
    """Raised inside a pass by a `DebugEvent` (tests only)."""


class DebugEvent(threading.Event):
    """A cancel flag for tests: every check sleeps `delay_s`, and with `fail_after` the
    n-th check raises `InjectedFault`."""

    def __init__(self, delay_s: float, fail_after: int | None = None) -> None:
        super().__init__()
        self._delay_s = delay_s
        self._checks_left = fail_after

    def is_set(self) -> bool:
        if self._delay_s > 0:
            time.sleep(self._delay_s)
        if self._checks_left is not None:
            self._checks_left -= 1
            if self._checks_left <= 0:
                raise InjectedFault("injected fault (debug_fail_prompt)")
        return super().is_set()


class FaultPlan:
    """Which requests get a slowed or failing cancel flag: every one slowed by
    `layer_delay_s`; the first whose text holds `fail_prompt` fails at check
    `fail_after` (one fault per daemon)."""

    def __init__(
        self, layer_delay_s: float = 0.0, fail_prompt: str | None = None, fail_after: int = 1
    ) -> None:
        self.layer_delay_s = layer_delay_s
        self.fail_prompt = fail_prompt
        self.fail_after = max(1, fail_after)

    def cancel_flag(
        self, prompt: str | None, messages: Sequence[Mapping[str, Any]] | None
    ) -> threading.Event:
        fail = None
        if self.fail_prompt and self.fail_prompt in _text(prompt, messages):
            fail, self.fail_prompt = self.fail_after, None
        if self.layer_delay_s > 0 or fail is not None:
            return DebugEvent(self.layer_delay_s, fail)
        return threading.Event()


def _text(prompt: str | None, messages: Sequence[Mapping[str, Any]] | None) -> str:
    if messages is not None:
        return " ".join(str(m.get("content", "")) for m in messages)
    return prompt or ""
