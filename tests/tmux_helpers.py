"""Driving a real terminal: a program run in tmux, typed at, and its screen read back."""

from __future__ import annotations

import subprocess
import time


class Tmux:
    """A private tmux server (`-L name`) with one session, `session`, driven by keys."""

    def __init__(self, name: str, session: str = "repl") -> None:
        self.base = ["tmux", "-L", name]
        self.session = session

    def run(self, *args: str) -> str:
        return subprocess.run(
            [*self.base, *args], capture_output=True, text=True, timeout=10
        ).stdout

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-J", "-S", "-200", "-t", self.session)

    def keys(self, *keys: str) -> None:
        self.run("send-keys", "-t", self.session, *keys)

    def wait(self, predicate, timeout_s: float = 20.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.1)
        raise AssertionError(f"timed out; screen:\n{self.screen()}")

    def alive(self) -> bool:
        return (
            subprocess.run(
                [*self.base, "has-session", "-t", self.session], capture_output=True
            ).returncode
            == 0
        )
