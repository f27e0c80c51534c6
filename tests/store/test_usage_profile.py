"""The usage profile: upstream .coli_usage is read, writes are atomic (kill -9 safe)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from colibrid.store.usage import UsageError, UsageProfile, cooc_path, engine_id_hash

UPSTREAM = "-1 79 256\n-2 1 3815245270\n3 0 17\n3 255 4\n78 7 2\n"


def test_engine_hash_matches_upstream() -> None:
    assert engine_id_hash("glm_moe_dsa") == 3815245270


def test_reads_upstream_file_and_legacy(tmp_path: Path) -> None:
    p = tmp_path / ".coli_usage"
    p.write_text(UPSTREAM)
    u = UsageProfile(79, 256, "glm_moe_dsa")
    assert u.merge_file(p) == 23
    assert u.counts[3, 0] == 17 and u.counts[78, 7] == 2
    legacy = tmp_path / "legacy"
    legacy.write_text("3 0 1\n")
    assert u.merge_file(legacy) == 1 and u.counts[3, 0] == 18


def test_refuses_other_models_by_name(tmp_path: Path) -> None:
    p = tmp_path / ".coli_usage"
    p.write_text(UPSTREAM)
    with pytest.raises(UsageError, match="another engine"):
        UsageProfile(79, 256, "deepseek_v3").merge_file(p)
    with pytest.raises(UsageError, match="79 layers"):
        UsageProfile(4, 16, "glm_moe_dsa").merge_file(p)
    assert UsageProfile(79, 256, "deepseek_v3").merge_file(p, trusted=True) == 23
    (tmp_path / "bad").write_text("1 2 3 4\n")
    with pytest.raises(UsageError, match="three integers"):
        UsageProfile(79, 256).merge_file(tmp_path / "bad")


def test_roundtrip_three_fields_and_cooc(tmp_path: Path) -> None:
    u = UsageProfile(4, 8, "glm4_moe", moe_layers=(1, 2, 3))
    u.record(1, [0, 3])
    u.record(2, [5])
    u.end_forward()
    u.record(1, [3])
    p = tmp_path / "u"
    u.save(p)
    lines = p.read_text().splitlines()
    assert lines[0] == "-1 4 8" and lines[1].startswith("-2 1 ")
    assert all(len(line.split()) == 3 for line in lines)
    assert u.within[1, 0, 3] == 1 and u.next[1, 3, 5] == 1 and u.next[1, 0, 5] == 1
    v = UsageProfile(4, 8, "glm4_moe", moe_layers=(1, 2, 3))
    assert v.merge_file(p) == 4
    assert np.array_equal(v.counts, u.counts) and np.array_equal(v.next, u.next)
    assert cooc_path(p).is_file()
    empty = UsageProfile(4, 8)
    empty.save(tmp_path / "e")
    assert (tmp_path / "e").read_bytes() == b""


WRITER = """
import sys
from colibrid.store.usage import UsageProfile
u = UsageProfile(8, 64, "glm_moe_dsa", moe_layers=range(8))
i = 0
print("ready", flush=True)
while True:
    i += 1
    u.record(i % 8, [i % 64, (i * 7) % 64])
    u.save(sys.argv[1])
"""


def test_survives_kill_9_at_any_moment(tmp_path: Path) -> None:
    for delay in (0.05, 0.13, 0.31):
        path = tmp_path / f"{delay}" / ".coli_usage"
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:  # a busy disk: first save
            time.sleep(0.01)
        time.sleep(delay)  # then kill it somewhere inside a later save
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        u = UsageProfile(8, 64, "glm_moe_dsa", moe_layers=range(8))
        got = u.merge_file(path)  # parses completely: never torn
        assert got > 0 and got % 2 == 0


@pytest.mark.parametrize("saved", [True, False])
def test_cooccurrences_are_counted_only_where_they_are_saved(
    oracle_checkpoint, tmp_path: Path, saved: bool
) -> None:
    """A run that saves its profile (`colibrid generate --profile FILE`) counts
    co-occurrences and writes the sidecar `convert --order` reads; the daemon's store
    (no file: its profile book keeps counts) does not pay for them."""
    from colibrid.config import Settings, store_options
    from colibrid.engine.engine import Engine
    from colibrid.engine.generate import generate
    from colibrid.engine.sampling import SamplingParams
    from colibrid.store.options import StoreOptions

    ref = oracle_checkpoint("glm4_moe")
    path = tmp_path / ".coli_usage"
    if saved:
        opts = StoreOptions(mode="tiered", cache=2, profile=str(path))
    else:  # what `colibrid start` opens with these knobs
        opts = store_options(Settings(cache=2), tmp_path / "profiles")
    engine = Engine.load(ref.out_dir, store=opts)
    try:
        list(generate(engine, ref.prompt_ids, SamplingParams(max_tokens=4, temperature=0.0)))
        profile = engine.experts.recorder.profile
        assert profile is not None and profile.cooc is saved
        assert (int(profile.within.sum()) > 0) is saved
    finally:
        engine.close()
    assert cooc_path(path).is_file() is saved
