"""Usage profiles: upstream's .coli_usage text format and per-profile counting (the pin
rule they feed is the store's: tests/store/test_pins.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

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
