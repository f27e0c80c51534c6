"""Usage profiles: upstream's .coli_usage text format and per-profile counting (the pin
rule they feed is the store's: tests/store/test_pins.py)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from colibrid.errors import PersistError
from colibrid.paths import atomic_write
from colibrid.serve.profiles import ProfileBook, read_profile
from colibrid.store.usage import UsageProfile, engine_id_hash, usage_text


def test_usage_file_round_trip_and_tolerance(tmp_path: Path) -> None:
    counts = np.zeros((3, 4), dtype=np.int64)
    counts[1, 2], counts[2, 0] = 7, 1
    path = tmp_path / "p.coli_usage"
    atomic_write(path, usage_text(counts, "glm4_moe"))
    lines = path.read_text().splitlines()
    assert lines[:2] == ["-1 3 4", f"-2 1 {engine_id_hash('glm4_moe')}"] and "1 2 7" in lines
    path.write_text(path.read_text() + "9 9 9\ngarbage\n1 1\n")
    assert (read_profile(path, (3, 4), "glm4_moe") == counts).all()  # bad lines skipped


def test_requests_count_into_their_profile(tmp_path: Path) -> None:
    book = ProfileBook(tmp_path, (2, 3), "glm4_moe", "default")
    book.add(None, [(0, np.array([0]))])
    book.add("code", [(1, np.array([1]))] * 4)
    book.add("code", [(5, np.array([1]))])  # a layer the profile does not have: ignored
    assert book.counts("default").sum() == 1 and book.counts("code")[1, 1] == 4
    book.save_all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["code.coli_usage", "default.coli_usage"]
    assert [row["name"] for row in book.listing()] == ["code", "default"]


def test_usage_files_interchange_with_the_store(tmp_path: Path) -> None:
    """What the daemon writes, the tiered store's UsageProfile reads (same model hash)."""
    book = ProfileBook(tmp_path, (2, 3), "glm4_moe", "default")
    book.add(None, [(0, np.array([1, 1])), (1, np.array([0]))])
    path = book.save()
    profile = UsageProfile(2, 3, model_type="glm4_moe", cooc=False)
    assert profile.merge_file(path) == 3
    assert profile.counts[0, 1] == 2


def _failing_writes(monkeypatch, fails: set[str], err: int = errno.ENOSPC) -> None:
    """atomic_write as on a disk that has no room for the files named in `fails`."""
    import colibrid.serve.profiles as profiles

    def write(path: Path, data: bytes | str) -> None:
        if path.name in fails:
            raise OSError(err, os.strerror(err))
        atomic_write(path, data)

    monkeypatch.setattr(profiles, "atomic_write", write)


def test_a_save_that_cannot_write_names_the_file_and_keeps_the_counts(
    tmp_path: Path, monkeypatch
) -> None:
    book = ProfileBook(tmp_path, (2, 3), "glm4_moe", "default")
    book.add(None, [(0, np.array([1]))])
    before = book.save()
    saved = before.read_bytes()
    book.add(None, [(1, np.array([2]))])
    _failing_writes(monkeypatch, {"default.coli_usage"})
    with pytest.raises(PersistError) as err:
        book.save()
    assert err.value.code == "IO"
    assert str(err.value) == f"cannot write {before}: No space left on device"
    assert before.read_bytes() == saved  # the last complete file stays
    assert book.counts("default").sum() == 2  # nothing counted is lost: the next save has it
    monkeypatch.undo()
    book.save()
    assert (read_profile(before, (2, 3), "glm4_moe") == book.counts("default")).all()


def test_save_all_tries_every_profile_and_reports_the_failures_together(
    tmp_path: Path, monkeypatch
) -> None:
    book = ProfileBook(tmp_path, (2, 3), "glm4_moe", "default")
    for name in ("a", "b", "c"):
        book.add(name, [(0, np.array([0]))])
    _failing_writes(monkeypatch, {"a.coli_usage", "c.coli_usage"}, errno.EIO)
    with pytest.raises(PersistError) as err:
        book.save_all()
    message = str(err.value)
    assert f"cannot write {book.path('a')}: Input/output error" in message
    assert f"cannot write {book.path('c')}: Input/output error" in message
    assert "b.coli_usage" not in message and book.path("b").is_file()  # b was still written


def test_profile_files_and_their_folders_are_private(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        book = ProfileBook(tmp_path / "profiles" / "model", (2, 3), "glm4_moe", "default")
        path = book.save()
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for folder in (path.parent, path.parent.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
