"""A demo build killed in its write phase leaves `models/.demo.partial-<pid>/` behind; the
next build removes it (its builder is dead) and never touches a live build's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colibrid.convert.demo import remove_stale_partials

pytestmark = pytest.mark.slow


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_partials_of_dead_builders_are_removed(tmp_path: Path) -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = tmp_path / f".demo.partial-{_dead_pid()}"
        (dead / "sub").mkdir(parents=True)
        (dead / "sub" / "x").write_bytes(b"x")
        running = tmp_path / f".demo.partial-{live.pid}"
        mine = tmp_path / f".demo.partial-{os.getpid()}"
        other = tmp_path / ".demo.partial-notapid"
        for folder in (running, mine, other):
            folder.mkdir()
        assert remove_stale_partials(tmp_path, ".demo.partial-") == [dead]
        assert not dead.exists() and running.exists() and mine.exists() and other.exists()
    finally:
        live.kill()
        live.wait()


def test_pull_killed_in_its_write_phase_is_cleaned_up_by_the_next(
    demo_gguf: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "COLIBRI_HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "colibri_cli", "pull", "demo", "--from", str(demo_gguf), "--quiet"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    partial = tmp_path / "models" / f".demo.partial-{proc.pid}"
    shard = partial / ".out-00000.safetensors.partial"
    deadline = time.monotonic() + 240
    try:
        while not (shard.is_file() and shard.stat().st_size > 1 << 20):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the build never reached its write phase"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert partial.is_dir(), "kill -9 leaves the partial folder (no clean-up can run)"
    again = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "models" / "demo" / "manifest.json").is_file()
    assert not list((tmp_path / "models").glob(".demo.partial-*"))
