"""`colibri repl` driven in tmux like a person: a question and its streamed answer, /stats,
Ctrl-C during a long answer (cancelled, still in the REPL), /profile, /quit."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest
from daemon_helpers import Home, wait_for
from tmux_helpers import Tmux

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")


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


def test_repl_asks_before_starting_a_daemon_the_user_stopped(home: Home, tmp_path: Path) -> None:
    """A REPL left open used to start a daemon the user had just stopped (`colibrid stop`)
    again at the next line: it asks now; "n" leaves it stopped and sends nothing, Enter
    starts it and the message is answered."""
    tmux = Tmux(f"colibri-test-{tmp_path.name}")
    command = f"env COLIBRI_HOME={home.path} {sys.executable} -m colibri_cli repl --max-tokens 4"
    tmux.run("new-session", "-d", "-s", "repl", "-x", "150", "-y", "50", command)
    question = "the daemon was stopped; start it again? [Y/n]"
    try:
        tmux.wait(lambda s: ">>>" in s)
        tmux.keys("first question", "Enter")
        tmux.wait(lambda s: s.count(">>>") >= 2)
        stopped = home.colibrid("stop")
        assert stopped.returncode == 0, stopped.stderr
        tmux.keys("second question", "Enter")
        tmux.wait(lambda s: question in s)
        tmux.keys("n", "Enter")
        tmux.wait(lambda s: "(not sent" in s and s.count(">>>") >= 3)
        assert home.colibrid("status").returncode == 3  # still stopped
        tmux.keys("third question", "Enter")
        tmux.wait(lambda s: s.count(question) == 2)
        tmux.keys("Enter")  # yes
        screen = tmux.wait(lambda s: "reconnected to the daemon" in s and s.count(">>>") >= 4)
        assert "error" not in screen.split("third question")[1], screen
        assert home.colibrid("status").returncode == 0
        tmux.keys("/stats", "Enter")
        tmux.wait(lambda s: "4 generated tokens" in s)
    finally:
        tmux.run("kill-server")


def test_repl_says_when_a_message_reloads_an_unloaded_model(home: Home, tmp_path: Path) -> None:
    """`colibri stop` unloads the model and the daemon stays: the REPL's next message
    loads it again, and says so first instead of reloading it in silence."""
    tmux = Tmux(f"colibri-test-{tmp_path.name}")
    command = f"env COLIBRI_HOME={home.path} {sys.executable} -m colibri_cli repl --max-tokens 4"
    tmux.run("new-session", "-d", "-s", "repl", "-x", "150", "-y", "50", command)
    notice = "colibri: no model is loaded (`colibri stop` or keep_alive); loading"
    try:
        tmux.wait(lambda s: ">>>" in s)
        tmux.keys("first question", "Enter")
        tmux.wait(lambda s: s.count(">>>") >= 2)
        assert notice not in tmux.screen()  # the model was loaded: nothing to say
        unloaded = home.colibri("stop")
        assert unloaded.returncode == 0, unloaded.stderr
        tmux.keys("second question", "Enter")
        screen = tmux.wait(lambda s: s.count(">>>") >= 3)
        after = screen.split("second question")[1]
        assert notice in after and "error" not in after, screen
        assert json.loads(home.colibri("ps", "--json").stdout)["model"] is not None
    finally:
        tmux.run("kill-server")


def test_run_on_a_terminal_opens_the_repl_on_that_model(
    home: Home, tmp_path: Path, demo_container: Path
) -> None:
    """`colibri run NAME` on a TTY: the model is loaded (a switch from the daemon's), then
    the REPL answers with it and passes --keep-alive on."""
    assert home.colibri("pull", str(demo_container), "--name", "demo").returncode == 0
    tmux = Tmux(f"colibri-test-{tmp_path.name}")
    command = (
        f"env COLIBRI_HOME={home.path} {sys.executable} -m colibri_cli run demo "
        "--max-tokens 6 --keep-alive 0"
    )
    tmux.run("new-session", "-d", "-s", "repl", "-x", "150", "-y", "50", command)
    try:
        tmux.wait(lambda s: ">>>" in s)
        assert json.loads(home.colibri("ps", "--json").stdout)["model"] == "demo"
        tmux.keys("What is the capital of France?", "Enter")
        tmux.wait(lambda s: s.count(">>>") >= 2 and "Paris" in s)
        tmux.keys("/quit", "Enter")
        assert wait_for(lambda: json.loads(home.colibri("ps", "--json").stdout)["model"] is None)
    finally:
        tmux.run("kill-server")
