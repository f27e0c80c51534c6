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
from matrix_support import MIXED_FROM, MIXED_KIND

from colibrid.engine.engine import Engine
from colibrid.engine.generate import TokenEvent, generate
from colibrid.engine.sampling import SamplingParams
from colibrid.serve.kernel_ceiling import token_bytes
from colibrid.store.experts import PROJECTIONS
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
    # the per-layer line adds up to the run's demand misses (6 tokens)
    stats = re.search(r"stream: hit [0-9.]+% of (\d+) lookups .* miss ([0-9.]+)%\)", out.stdout)
    layers = re.search(r"demand misses a token by MoE layer: (.*)", out.stdout)
    assert stats and layers, out.stdout
    per_layer = [float(x.split(": ")[1]) for x in layers.group(1).split(", ")]
    lookups, miss_pct = int(stats.group(1)), float(stats.group(2))
    misses = 6 * sum(per_layer)
    assert misses > 0 and abs(misses - lookups * miss_pct / 100) <= 0.0005 * lookups + 0.2


def test_bench_stream_against_the_uniform_container_pairs_the_runs(mixed, streamed_model) -> None:
    """`bench stream --against`: the uniform container and the plan alternate at the same
    budget, and each ratio line is the plan's figure over the uniform run just before it
    (read back from the table the same output prints)."""
    path, _ = mixed
    uniform = streamed_model(MIXED_FROM).path
    out = subprocess.run(
        [sys.executable, "-m", "colibri_cli", "bench", "stream", "--model", str(path)]
        + ["--against", str(uniform), "--rounds", "2", "--cache", "1", "--pilot", "off"]
        + ["--tokens", "4", "--warmup", "1", "--probe-reads", "8", "--temperature", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = re.findall(
        r"^\| (\d) \| (\S+) \| ([0-9.]+) \| [0-9.]+% \| ([0-9.e+-]+) \|", out.stdout, re.M
    )
    assert [(n, name) for n, name, *_ in rows] == [
        ("1", uniform.name),
        ("2", path.name),
        ("3", uniform.name),
        ("4", path.name),
    ], out.stdout
    ratios = re.search(r"bytes read a token: ([0-9.]+), ([0-9.]+) \(median", out.stdout)
    assert ratios, out.stdout
    read = [float(r[3]) for r in rows]
    for got, (a, b) in zip(ratios.groups(), ((0, 1), (2, 3)), strict=True):
        assert read[a] > 0 and float(got) == pytest.approx(read[b] / read[a], rel=2e-3)


def expert_bytes(engine: Engine) -> list[int]:
    """Every routed expert's stored bytes (three matrices), layer by layer."""
    store, ckpt = engine.experts.layout, engine.checkpoint
    return [
        sum(ckpt.weight(store.tensor_name(la, e, p), store.shape(p)).nbytes for p in PROJECTIONS)
        for la in store.profiled_layers
        for e in range(store.n_experts)
    ]


def test_the_kernel_ceiling_prices_a_routed_pick_at_the_plans_mean_expert(
    mixed, streamed_model
) -> None:
    """The live roofline's kernel ceiling on a mixed container: the same model's uniform
    container differs from it only in routed experts, so the priced bytes differ by the
    top-k picks times (the plan's mean expert - the uniform expert), not by the first
    expert's format."""
    engines = [
        Engine.load(path, store=StoreOptions(mode="resident"))
        for path in (mixed[0], streamed_model(MIXED_FROM).path)
    ]
    try:
        plan, uniform = (expert_bytes(e) for e in engines)
        assert len(set(plan)) > 1 and len(set(uniform)) == 1  # the formats really differ
        picks = engines[0].args.moe.num_experts_per_tok * len(
            engines[0].experts.layout.profiled_layers
        )
        priced = [sum(token_bytes(e).values()) for e in engines]
        want = picks * (sum(plan) / len(plan) - uniform[0])
        assert priced[0] - priced[1] == pytest.approx(want, rel=1e-9)
    finally:
        for e in engines:
            e.close()
