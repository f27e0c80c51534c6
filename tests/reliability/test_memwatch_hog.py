"""A memory hog next to the real daemon: MEMWATCH shrinks the streamed cache, gives it back
when the hog goes, and no answer changes (docs/architecture.md).

The daemon runs the built-in demo with its experts streamed (`cache = 8` of 16 per layer,
so the cache is most of what placement holds) and `memory_floor_gb` set 1.5 GiB under
what the machine has free before it starts. One answer (A); then another process
allocates and touches enough memory to take the machine ~1 GiB under that floor, and the
next answer must equal A while STATUS shows the cache shrunk; the hog is killed and the
next answer must equal A again while the cache grows back to its ceiling (8). The hog is
killed in every outcome. Memory other processes take or free on a shared machine moves
the floor's margin, so the hog is sized from MemAvailable after the daemon started.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_helpers import Home

from colibri_cli.client import Client
from colibrid.store.budget import mem_available

GiB = 1 << 30
CACHE = 8
ASK = ("ask", "--temperature", "0", "--max-tokens", "12", "Write a short line about the sea")
HOG = """
import sys, time
hog = bytearray(int(sys.argv[1]))
for i in range(0, len(hog), 4096):  # touch every page: calloc'd pages are not held yet
    hog[i] = 1
print("held", flush=True)
time.sleep(120)
"""

pytestmark = pytest.mark.skipif(
    mem_available() < 6 * GiB,
    reason="needs 6 GiB of MemAvailable: a ~2.5 GiB hog must fit next to the daemon",
)


def store_status(home: Home) -> dict:
    with Client.connect(home.socket, timeout_s=10) as client:
        return client.query("STATUS")["tiers"]["store"]


def answer(home: Home) -> str:
    result = home.colibri(*ASK, timeout=30)
    assert result.returncode == 0, result.stderr + home.log()
    return result.stdout


def test_a_hog_shrinks_the_cache_and_its_exit_grows_it_back(
    demo_container: Path, tmp_path: Path
) -> None:
    floor = mem_available() - int(1.5 * GiB)
    home = Home(
        tmp_path / "home",
        demo_container,
        cache=CACHE,
        memory_floor_gb=round(floor / GiB, 3),
        prompt_cache=False,  # every answer computed, none replayed from remembered logits
    )
    hog: subprocess.Popen | None = None
    try:
        home.start()
        st = store_status(home)
        assert st["streams"] and st["cache_per_layer"] == CACHE, st
        assert st["memwatch"].startswith("on: floor "), st["memwatch"]
        assert f"cache {CACHE}/{CACHE} experts/layer" in st["memwatch"], st["memwatch"]
        text_a = answer(home)

        hog_bytes = min(int(3.5 * GiB), max(int(2.5 * GiB), mem_available() - floor + GiB))
        hog = subprocess.Popen(
            [sys.executable, "-c", HOG, str(hog_bytes)], stdout=subprocess.PIPE, text=True
        )
        assert hog.stdout is not None and hog.stdout.readline().strip() == "held"
        time.sleep(0.3)  # the watch samples every 0.1 s
        assert answer(home) == text_a
        st = store_status(home)
        assert st["cache_per_layer"] < CACHE, st["memwatch"]
        assert st["memwatch"].startswith("shrink"), st["memwatch"]

        hog.kill()
        hog.wait()
        grown = None
        for _ in range(3):  # a neighbour's allocation may hold the room for a moment
            time.sleep(0.3)
            assert answer(home) == text_a
            grown = store_status(home)
            if grown["cache_per_layer"] == CACHE:
                break
        assert grown is not None and grown["cache_per_layer"] == CACHE, grown["memwatch"]
        assert grown["memwatch"].startswith("grow cache "), grown["memwatch"]
        assert f"-> {CACHE} of {CACHE} experts/layer" in grown["memwatch"], grown["memwatch"]
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        home.close()
