"""A mixed-precision container streamed: its cache holds experts by their bytes, and no
token changes (issue 41).

The tiny GLM-5 requantised into hot int8, middle int4 and cold int3-affine experts
(matrix_support.mixed_model): a slot is an int8 expert's size, so a cache of one slot a
layer holds two cold experts. Streamed at cache 1 and 2 (PILOT off and on), the 32-token
teacher-forced prefill and 20 greedy tokens must equal the resident store's bytes, the
store's bookkeeping must be whole, each layer's cache within its bytes and the memory kept
faulted within the uniform plan's; with PILOT off every byte read was a needed miss, which
is what `bench stream`'s strict roofline now counts.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
from matrix_support import MIXED_KIND

from colibrid.engine.engine import Engine
from colibrid.engine.generate import TokenEvent, generate
from colibrid.engine.sampling import SamplingParams
from colibrid.store.options import StoreOptions
from colibrid.store.tiered import TieredStore

PREFILL = [(7 * i + 3) % 200 + 1 for i in range(32)]
PROMPT = [5, 17, 42, 9]


def decode(engine: Engine) -> tuple[bytes, list[int]]:
    logits = np.asarray(engine.new_session().prefill(PREFILL, all_logits=True))
    params = SamplingParams(max_tokens=20, temperature=0.0)
    ids = [e.token_id for e in generate(engine, PROMPT, params) if isinstance(e, TokenEvent)]
    return logits.tobytes(), ids


@pytest.fixture(scope="module")
def mixed(streamed_model):
    model = streamed_model(MIXED_KIND)
    engine = Engine.load(model.path, store=StoreOptions(mode="resident"))
    try:
        return model.path, decode(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("cache,pilot", [(1, "off"), (2, "on")])
def test_streamed_mixed_cache_holds_by_bytes_and_matches_resident(mixed, cache, pilot) -> None:
    path, want = mixed
    engine = Engine.load(path, store=StoreOptions(mode="tiered", cache=cache, pilot=pilot))
    try:
        store = engine.experts
        assert isinstance(store, TieredStore) and store.reader.sizes.mixed
        assert decode(engine) == want  # placement never changes a token
        store.check_consistency()  # slots, tiers and kept bytes all accounted
        pl = store.placement
        assert all(pl.cache_used[la] <= pl.cache_capacity for la in pl.cache)
        # more experts than slots' count: the small ones keep only their bytes
        assert max(len(c) for c in pl.cache.values()) > pl.cache_per_layer
        unit = store.reader.sizes.unit
        assert store.resident_bytes() <= pl.wanted_faulted() * unit
        st = store.statistics()
        largest = max(x.read_bytes for row in store.extents.values() for x in row)
        assert 0 < st.needed_bytes < (st.misses + st.hits_prefetched) * largest
        if pilot == "off":  # no guesses: every read was a chosen expert that was missing
            assert st.needed_bytes == st.bytes_read
    finally:
        engine.close()


def test_bench_stream_strict_roofline_counts_the_missed_experts_bytes(mixed) -> None:
    """`bench stream` with PILOT off: every read is a needed miss, so the strict roofline's
    GB a token is the GB read a token, not misses times a mean expert size."""
    path, _ = mixed
    out = subprocess.run(
        [sys.executable, "-m", "colibri_cli", "bench", "stream", "--model", str(path)]
        + ["--cache", "1", "--pilot", "off", "--tokens", "6", "--warmup", "1"]
        + ["--probe-reads", "8", "--temperature", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    read = re.search(r"cache: ([0-9.e+-]+) GB read/token", out.stdout)
    needed = re.search(r"needed experts only\): [0-9.]+ tok/s \(([0-9.e+-]+) GB", out.stdout)
    assert read and needed, out.stdout
    assert float(needed.group(1)) == float(read.group(1)) > 0, out.stdout
