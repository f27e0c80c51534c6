"""Usage profiles: upstream's .coli_usage text format, pin choice, per-profile counting."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from colibrid.errors import ColibriError
from colibrid.paths import atomic_write
from colibrid.serve.profiles import (
    ProfileBook,
    RecordedPins,
    choose_pins,
    pin_target,
    read_profile,
)
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


def test_choose_pins_top_counts_ties_to_lowest_index() -> None:
    counts = np.array([[5, 0, 5], [1, 9, 0]])
    assert choose_pins(counts, 2) == [(1, 1), (0, 0)]  # hottest first
    assert choose_pins(counts, 10) == [(1, 1), (0, 0), (0, 2), (1, 0)]  # zeros never pinned


def test_requests_count_into_their_profile(tmp_path: Path) -> None:
    pins = RecordedPins()
    book = ProfileBook(tmp_path, (2, 3), "glm4_moe", "default", pins, pin_budget=1)
    book.add(None, np.array([[1, 0, 0], [0, 0, 0]]))
    book.add("code", np.array([[0, 0, 0], [0, 4, 0]]))
    assert book.counts("default").sum() == 1 and book.counts("code")[1, 1] == 4
    book.active = "code"
    pins.set_pinned(book.pin_set())
    assert pins.pinned == {(1, 1)}
    book.save_all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["code.coli_usage", "default.coli_usage"]
    assert [row["name"] for row in book.listing()] == ["code", "default"]


class FakeTieredStore:
    """The pin surface of colibrid.store.tiered.TieredStore, with two pin slots."""

    def __init__(self) -> None:
        self.pinned: dict[tuple[int, int], int] = {(0, 0): 0}
        self.free = [1]

    def pin(self, keys):
        for key in keys:
            if not self.free:
                raise ColibriError("no free slot to pin into")
            self.pinned[key] = self.free.pop()

    def unpin(self, key):
        self.free.append(self.pinned.pop(key))


def test_store_pins_swap_within_the_store_budget() -> None:
    store = FakeTieredStore()
    target = pin_target(store)
    target.set_pinned([(1, 2), (1, 1), (0, 3)])  # hottest first; room for two
    assert target.pinned == {(1, 2), (1, 1)}
    assert isinstance(pin_target(object()), RecordedPins)


def test_usage_files_interchange_with_the_store(tmp_path: Path) -> None:
    """What the daemon writes, the tiered store's UsageProfile reads (same model hash)."""
    book = ProfileBook(tmp_path, (2, 3), "glm4_moe", "default", RecordedPins(), 1)
    book.add(None, np.array([[0, 2, 0], [1, 0, 0]]))
    path = book.save()
    profile = UsageProfile(2, 3, model_type="glm4_moe", cooc=False)
    assert profile.merge_file(path) == 3
    assert profile.counts[0, 1] == 2
