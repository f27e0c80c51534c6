"""The socket's directory must be the daemon user's and closed to others (issue 45):
whoever owns or can write it can move the socket aside and answer in the daemon's place."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from colibrid.errors import ConfigError
from colibrid.paths import Paths


def paths_in(home: Path) -> Paths:
    return Paths(home=home, socket=home / "run" / "colibrid.sock")


def start(home: Path) -> subprocess.CompletedProcess:
    """`colibrid start`: the directory is checked before any model is looked at."""
    env = {**os.environ, "COLIBRI_HOME": str(home)}
    env.pop("COLIBRI_SOCKET", None)
    return subprocess.run(
        [sys.executable, "-m", "colibrid", "start", "--wait", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_run_dir_others_can_write_is_refused_with_what_to_fix(tmp_path: Path) -> None:
    paths = paths_in(tmp_path)
    paths.run.mkdir(parents=True)
    paths.run.chmod(0o777)
    with pytest.raises(ConfigError, match=r"open to other users \(mode 777.*chmod 700"):
        paths.ensure()
    assert stat.S_IMODE(paths.run.stat().st_mode) == 0o777  # not silently "fixed"
    result = start(tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "chmod 700" in lines[0] and str(paths.run) in lines[0], lines
    assert not paths.socket.exists()


def test_a_run_dir_group_can_write_is_refused(tmp_path: Path) -> None:
    paths = paths_in(tmp_path)
    paths.run.mkdir(parents=True)
    paths.run.chmod(0o770)
    with pytest.raises(ConfigError, match="mode 770"):
        paths.ensure()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder away needs root")
def test_a_run_dir_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    paths = paths_in(tmp_path)
    paths.run.mkdir(parents=True, mode=0o700)
    os.chown(paths.run, 65534, 65534)  # nobody's, and private: still not ours
    with pytest.raises(ConfigError, match=r"belongs to uid 65534, not to this user \(uid 0\)"):
        paths.ensure()
    result = start(tmp_path)
    assert result.returncode == 1 and "belongs to uid 65534" in result.stderr, result.stderr
    assert not paths.socket.exists()


def test_our_run_dir_that_others_can_only_enter_is_tightened(tmp_path: Path) -> None:
    """An older version's 0755 run/: made 0700, not refused."""
    paths = paths_in(tmp_path)
    paths.run.mkdir(parents=True)
    paths.run.chmod(0o755)
    paths.ensure()
    assert stat.S_IMODE(paths.run.stat().st_mode) == 0o700
