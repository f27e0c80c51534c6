"""The pieces of `colibri bench peer --far` that run without llama.cpp: the balloon locks
memory or says why it cannot, a model too small for the method is refused with the way
to build one, and the I/O counter counts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_cli.main import main
from colibrid.bench import peer_far
from colibrid.errors import ConfigError
from colibrid.store.budget import mem_available


def test_balloon_locks_what_it_is_asked_to_and_gives_it_back() -> None:
    leave_gb = max(0.0, (mem_available() - (300 << 20)) / (1 << 30))
    proc = subprocess.Popen(
        [sys.executable, "-m", "colibrid.bench.balloon", "--leave-gb", f"{leave_gb:.4f}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    proc.stdin.close()
    rc = proc.wait(timeout=60)
    if line.startswith("ready"):
        assert rc == 0 and int(line.split()[1]) == 256 << 20  # one 256 MiB piece
    else:  # not root and a small `ulimit -l`: one clear line, not a traceback
        assert rc == 1 and "mlock refused" in proc.stderr.read()


def test_a_model_smaller_than_four_times_what_is_left_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "m"
    args = ["synth", "--shape", "glm4-tiny", "--layers", "2", "--experts", "2", "--quiet"]
    assert main([*args, str(d)]) == 0
    with pytest.raises(ConfigError, match=r"at least 4x .*--layers N"):
        peer_far.run(d, None, 4.0, 4, 4)
    assert not d.with_name("m.gguf").exists(), "refused before writing anything"


def test_read_bytes_counts_what_the_drive_delivers(tmp_path: Path) -> None:
    if not Path("/proc/self/io").exists():
        pytest.skip("no /proc/self/io here")
    f = tmp_path / "f"
    f.write_bytes(os.urandom(8 << 20))
    fd = os.open(f, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache
        before = peer_far.read_bytes()
        while os.read(fd, 1 << 20):
            pass
    finally:
        os.close(fd)
    if peer_far.read_bytes() == before:
        pytest.skip("this filesystem keeps the file cached (tmpfs): nothing reached a drive")
    assert peer_far.read_bytes() - before >= 4 << 20
