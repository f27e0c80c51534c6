"""`colibri service`: the systemd unit it writes passes `systemd-analyze verify` and runs
this install's colibrid; the launchd agent is a valid plist that runs the same."""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_cli.commands import service

COLIBRID = str(Path(sys.executable).parent / "colibrid")


def _colibri(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "colibri_cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_install_writes_a_unit_systemd_accepts(tmp_path: Path) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the systemd unit is for Linux")
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config"), "COLIBRI_HOME": str(tmp_path / "home")}
    done = _colibri("service", "install", "--no-start", env=env)
    assert done.returncode == 0, done.stderr
    unit = tmp_path / "config" / "systemd" / "user" / "colibrid.service"
    text = unit.read_text()
    assert f"ExecStart={COLIBRID} run\n" in text
    assert f"Environment=COLIBRI_HOME={tmp_path / 'home'}\n" in text
    assert "@" not in text.replace("@...@", "")  # every template field filled in
    if shutil.which("systemd-analyze"):
        verify = subprocess.run(
            ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True
        )
        assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr
    printed = _colibri("service", "install", "--print", env=env)
    assert printed.stdout == text
    removed = _colibri("service", "uninstall", env=env)
    assert removed.returncode == 0 and not unit.exists()
    assert "not installed" in _colibri("service", "status", env=env).stdout


def test_launchd_agent_is_a_plist_that_runs_colibrid(tmp_path: Path) -> None:
    kind = service.service_kind("darwin")
    assert kind.target.name == "org.colibri.colibrid.plist"
    agent = plistlib.loads(service.render(kind, COLIBRID, tmp_path).encode())
    assert agent["Label"] == "org.colibri.colibrid"
    assert agent["ProgramArguments"] == [COLIBRID, "run"]
    assert agent["EnvironmentVariables"]["COLIBRI_HOME"] == str(tmp_path)
    assert agent["StandardErrorPath"] == str(tmp_path / "colibrid.log")


def test_an_unknown_platform_is_one_clear_line() -> None:
    with pytest.raises(SystemExit, match="colibrid run"):
        service.service_kind("sunos5")
