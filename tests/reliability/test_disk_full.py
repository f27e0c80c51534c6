"""A full disk costs the writes, never the daemon or what is already on disk.

The real daemon (the tiny chat model) keeps its profiles/ and kv/ on a small tmpfs
(through symlinks, so the log stays writable and can say what was not saved), which is
then filled: saving a profile fails with a line naming the file, asking still answers the
same text, the stop is clean, and the files saved before are byte-identical. A start on a
full home fails with one line naming the file. Mounting needs root; without it the start
test falls back to RLIMIT_FSIZE (EFBIG), the serving test is skipped.

Start-up housekeeping: the temp files a killed atomic write leaves are removed (only
those of atomic_file's own pattern) and profiles/ and the log are made private.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from colibri_protocol.codec import encode_line
from daemon_helpers import Home, alive, wait_for

from colibri_cli.client import Client, ClientError
from colibrid import daemon
from colibrid.errors import PersistError
from colibrid.paths import Paths, atomic_write, make_state_private, remove_orphan_temps
from colibrid.serve import models

ASK = ("ask", "--temperature", "0", "--max-tokens", "8", "What is the capital of France?")
NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"


# ---- a small disk ---------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs at tmp_path/disk (skipped where mounting is not allowed); unmounted
    at the end whatever happened (lazily: a daemon that failed to stop may hold it)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(disk: Path) -> None:
    """Write a filler until the disk is full: every new page of any file fails after this."""
    with open(disk / "filler", "wb", buffering=0) as filler:
        chunk = b"\0" * 65536
        try:
            while True:
                filler.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        try:
            while True:
                filler.write(b"\0")
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes (not a temp file of a save in flight)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and p.suffix != ".tmp"
    }


def answer(home: Home) -> str:
    result = home.colibri(*ASK)
    assert result.returncode == 0, result.stderr + home.log()
    return result.stdout


# ---- serving on a full disk -----------------------------------------------------------------
def test_a_full_disk_costs_the_saves_not_the_daemon(
    chat_model: Path, tmp_path: Path, small_disk: Path
) -> None:
    home = Home(tmp_path / "home", chat_model, shutdown_grace_s=1.0, profile_save_s=0.3)
    for state in ("profiles", "kv"):  # the state on the small disk, the log beside it
        (small_disk / state).mkdir(mode=0o700)
        (home.path / state).symlink_to(small_disk / state)
    profiles = small_disk / "profiles" / chat_model.name
    home.start()
    try:
        before = answer(home)
        saved = home.colibri("profile", "save", "early")
        assert saved.returncode == 0, saved.stderr
        assert wait_for(lambda: (profiles / "default.coli_usage").is_file())
        time.sleep(0.7)  # two more periodic saves: the files hold every count of the ask
        kept = snapshot(small_disk)
        assert {"profiles/model/early.coli_usage", "profiles/model/default.coli_usage"} <= set(
            kept
        ), kept.keys()

        fill(small_disk)
        refused = home.colibri("profile", "save", "x")
        assert refused.returncode != 0
        assert str(home.path / "profiles" / chat_model.name / "x.coli_usage") in refused.stderr
        assert NO_SPACE in refused.stderr and "IO" in refused.stderr, refused.stderr
        assert answer(home) == before  # serving goes on, tokens unchanged
        with Client.connect(home.socket, timeout_s=30) as client:
            with pytest.raises(ClientError) as flush:
                client.call(encode_line("PROFILE", "FLUSH"), want=("OK",))
        assert flush.value.code == "IO" and NO_SPACE in str(flush.value)
        assert "cannot write" in str(flush.value) and "default.coli_usage" in str(flush.value)

        # the periodic saver says so once per distinct failure, not every period
        assert wait_for(lambda: "profiles not saved (trying again" in home.log())
        time.sleep(0.9)  # three more periods
        failures = home.log().count("profiles not saved (trying again")
        time.sleep(0.9)
        assert home.log().count("profiles not saved (trying again") == failures <= 3
        assert alive(home.pid())

        pid = home.pid()
        stopped = home.colibrid("stop")
        assert stopped.returncode == 0, stopped.stderr + home.log()
        assert wait_for(lambda: not alive(pid))
        log = home.log()
        assert "profiles NOT saved" in log and "profiles not saved: cannot write" in log
        assert f"prompt cache not saved to {home.path / 'kv' / chat_model.name}" in log
        assert "Traceback" not in log, log
        # what was saved before the disk filled is whole and unchanged; no temp is left
        assert snapshot(small_disk) == kept | {"filler": (small_disk / "filler").read_bytes()}
        assert not [p for p in small_disk.rglob("*.tmp")]
    finally:
        home.close()


# ---- starting on a full disk ----------------------------------------------------------------
def _full_fsize() -> None:
    """preexec_fn: no file of this process tree may grow (writes fail with EFBIG)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


def _can_mount(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True
    )
    if done.returncode == 0:
        subprocess.run(["umount", str(probe)], capture_output=True)
    return done.returncode == 0


def test_a_start_on_a_full_home_fails_with_one_line_naming_the_file(
    chat_model: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if _can_mount(tmp_path):
        disk = request.getfixturevalue("small_disk")
        home = Home(disk / "home", chat_model)
        fill(disk)
        reason, preexec = NO_SPACE, None
    else:  # no mount allowed: a file-size limit of 0 fails every write the same way
        home = Home(tmp_path / "home", chat_model)
        reason, preexec = os.strerror(errno.EFBIG), _full_fsize
    try:
        result = subprocess.run(
            [sys.executable, "-m", "colibrid", "start", "--wait", "60"],
            env=home.env,
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=preexec,
        )
        assert result.returncode == 1, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert lines[0] == f"colibrid: error: cannot write {home.pidfile}: {reason}", lines
        assert home.colibrid("status").returncode == 3  # nothing was left running
    finally:
        home.close()


# ---- start-up housekeeping ------------------------------------------------------------------
def _orphan(folder: Path, target: str) -> Path:
    """A temp file as atomic_file names them (mkstemp's 8 random characters)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".{target}.{uuid.uuid4().hex[:7]}_.tmp"
    path.write_bytes(b"half a write")
    return path


def test_start_removes_orphan_temps_and_makes_state_private(
    chat_model: Path, tmp_path: Path
) -> None:
    home = Home(tmp_path / "home", chat_model, shutdown_grace_s=1.0)
    model = chat_model.name
    profiles, kv = home.path / "profiles", home.path / "kv"
    orphans = [
        _orphan(profiles / model, "default.coli_usage"),
        _orphan(kv / model, "0.npz"),
        _orphan(home.path, "config.toml"),
        _orphan(home.path / "run", "colibrid.pid"),
    ]
    kept = [  # a user's files with similar names, and what is not a file
        profiles / model / ".notes.tmp",
        profiles / model / "draft.coli_usage.tmp",
        profiles / model / ".default.coli_usage.tmp",
        profiles / model / ".default.coli_usage.toolong123.tmp",
        home.path / "models" / ".weights.abcdefgh.tmp",  # models/ is never swept
    ]
    for path in kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("mine")
    (profiles / model / ".dir.abcdefgh.tmp").mkdir()
    (profiles / model / ".link.abcdefgh.tmp").symlink_to(home.path / "config.toml")
    # an older version's modes: open folders, a readable heat map and log
    heat_map = profiles / model / "default.png"
    heat_map.write_bytes(b"png")
    log = home.path / "colibrid.log"
    log.write_text("an older daemon's log\n")
    for path, mode in ((profiles, 0o755), (profiles / model, 0o755), (heat_map, 0o644)):
        os.chmod(path, mode)
    os.chmod(log, 0o644)

    home.start()
    try:
        assert not [p for p in orphans if p.exists()]
        assert all(p.exists() for p in kept)
        assert (profiles / model / ".dir.abcdefgh.tmp").is_dir()
        assert (profiles / model / ".link.abcdefgh.tmp").is_symlink()
        assert f"removed {len(orphans)} orphan temp file(s)" in home.log()
        answer(home)
        assert home.colibri("profile", "save", "later").returncode == 0
        assert home.colibrid("stop").returncode == 0
    finally:
        home.close()
    files = [p for p in (profiles / model).iterdir() if p.is_file() and not p.is_symlink()]
    assert {"default.coli_usage", "later.coli_usage"} <= {p.name for p in files}
    for folder in (profiles, profiles / model, kv, kv / model, home.path / "run"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    for path in [*files, *(kv / model).iterdir(), log]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_orphans_are_removed_only_when_old_unless_the_lock_is_held(tmp_path: Path) -> None:
    fresh = _orphan(tmp_path / "profiles" / "m", "a.coli_usage")
    old = _orphan(tmp_path / "kv" / "m", "0.npz")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    assert remove_orphan_temps(tmp_path) == [old]  # a fresh one may be a write in flight
    assert fresh.exists()
    assert remove_orphan_temps(tmp_path, lock_held=True) == [fresh]


def test_new_state_is_private_under_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        target = tmp_path / "a" / "b" / "f.bin"
        atomic_write(target, b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    for folder in (target.parent, target.parent.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    paths = Paths(home=tmp_path, socket=tmp_path / "run" / "colibrid.sock")
    assert make_state_private(paths) == 0  # nothing to tighten


# ---- the saver and the final save -----------------------------------------------------------
class FullBook:
    """A profile book on a full disk."""

    directory = Path("/full/profiles/model")

    def __init__(self) -> None:
        self.calls = 0

    def save_all(self) -> list[Path]:
        self.calls += 1
        raise PersistError(f"cannot write {self.directory}/default.coli_usage: {NO_SPACE}")


def test_the_saver_logs_a_failure_once_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    book = FullBook()

    class Slot:  # the model slot, holding a model whose profiles cannot be written
        current = type("Loaded", (), {"book": book})()

    async def main() -> None:
        with trio.move_on_after(0.3):
            await daemon.save_profiles(Slot(), 0.01)  # type: ignore[arg-type]

    with caplog.at_level(logging.INFO, logger="colibrid"):
        trio.run(main)
    assert book.calls >= 5
    warnings = [r.getMessage() for r in caplog.records if "not saved" in r.getMessage()]
    assert len(warnings) == 1 and "default.coli_usage" in warnings[0] and NO_SPACE in warnings[0]


def test_the_final_save_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    class BrokenHost:
        def save_prompt_cache(self, directory: Path) -> int:
            raise ValueError("a bug in the writer")

    class FullHost:
        def save_prompt_cache(self, directory: Path) -> int:
            raise OSError(errno.ENOSPC, NO_SPACE)

    with caplog.at_level(logging.INFO, logger="colibrid"):
        assert models.save_profiles_finally(FullBook()) is False  # type: ignore[arg-type]
        assert models.save_prompt_cache(FullHost(), Path("/full/kv/m")) == 0  # type: ignore[arg-type]
        assert models.save_prompt_cache(BrokenHost(), Path("/full/kv/m")) == 0  # type: ignore[arg-type]
    text = caplog.text
    assert (
        f"profiles not saved: cannot write /full/profiles/model/default.coli_usage: {NO_SPACE}"
        in text
    )
    assert f"prompt cache not saved to /full/kv/m: {NO_SPACE}" in text
    assert "a bug in the writer" in text
