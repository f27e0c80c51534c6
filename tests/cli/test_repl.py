"""`colibri repl` driven in tmux like a person: a question and its streamed answer, /stats,
Ctrl-C during a long answer (cancelled, still in the REPL), /profile, /quit."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_helpers import Home

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")


class Tmux:
    def __init__(self, name: str) -> None:
        self.base = ["tmux", "-L", name]

    def run(self, *args: str) -> str:
        return subprocess.run(
            [*self.base, *args], capture_output=True, text=True, timeout=10
        ).stdout

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-J", "-S", "-200", "-t", "repl")

    def keys(self, *keys: str) -> None:
        self.run("send-keys", "-t", "repl", *keys)

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
                [*self.base, "has-session", "-t", "repl"], capture_output=True
            ).returncode
            == 0
        )


@pytest.fixture
def home(chat_model: Path, tmp_path_factory) -> Home:
    h = Home(tmp_path_factory.mktemp("repl"), chat_model, debug_layer_delay_s=0.01)
    h.start()
    yield h
    h.close()


def test_repl_in_tmux(home: Home, tmp_path: Path) -> None:
    tmux = Tmux(f"colibri-test-{tmp_path.name}")
    command = f"env COLIBRI_HOME={home.path} {sys.executable} -m colibri_cli repl --max-tokens 8"
    tmux.run("new-session", "-d", "-s", "repl", "-x", "150", "-y", "50", command)
    try:
        tmux.wait(lambda s: ">>>" in s)
        tmux.keys("What is the capital?", "Enter")
        tmux.wait(lambda s: s.count(">>>") >= 2)  # answered, back at the prompt
        tmux.keys("/stats", "Enter")
        tmux.wait(lambda s: "8 generated tokens" in s)
        tmux.keys("/set max_tokens 240", "Enter")
        tmux.wait(lambda s: "max_tokens = 240" in s)
        before = tmux.screen()
        tmux.keys("Tell me a long story", "Enter")
        tmux.wait(lambda s: len(s.rstrip()) > len(before.rstrip()) + 30)  # streaming
        tmux.keys("C-c")
        tmux.wait(lambda s: "(cancelled)" in s, timeout_s=5)
        tmux.keys("/profile nosuch", "Enter")
        tmux.wait(lambda s: "NOT_FOUND" in s and "--create" in s)
        tmux.keys("/profile code --create", "Enter")
        tmux.wait(lambda s: "(active profile: code)" in s)
        status = home.colibri("ps")
        assert "code" in status.stdout
        tmux.keys("/quit", "Enter")
        deadline = time.monotonic() + 10
        while tmux.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not tmux.alive()
        history = home.path / "repl_history"
        assert history.read_text().count("What is the capital?") == 1
        assert history.stat().st_mode & 0o777 == 0o600, "what was typed stays private"
    finally:
        tmux.run("kill-server")


def test_repl_reconnects_when_the_daemon_comes_back(home: Home, tmp_path: Path) -> None:
    """It used to answer every line with 'lost the daemon: Broken pipe' until restarted."""
    tmux = Tmux(f"colibri-test-{tmp_path.name}")
    command = f"env COLIBRI_HOME={home.path} {sys.executable} -m colibri_cli repl --max-tokens 4"
    tmux.run("new-session", "-d", "-s", "repl", "-x", "150", "-y", "50", command)
    try:
        tmux.wait(lambda s: ">>>" in s)
        tmux.keys("first question", "Enter")
        tmux.wait(lambda s: s.count(">>>") >= 2)
        home.close()  # the daemon goes away, and comes back
        home.start()
        tmux.keys("second question", "Enter")
        screen = tmux.wait(lambda s: "reconnected to the daemon" in s and s.count(">>>") >= 3)
        assert "Broken pipe" not in screen and "error" not in screen.split("second question")[1]
        tmux.keys("/stats", "Enter")
        tmux.wait(lambda s: "4 generated tokens" in s)
    finally:
        tmux.run("kill-server")
