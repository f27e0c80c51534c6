"""The tiered store's parts: aligned extents, direct-I/O fallback, policies against
Belady, MEMWATCH resizing (fake and real memory pressure) and telemetry."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from colibrid.engine.engine import Engine
from colibrid.engine.generate import TokenEvent, generate
from colibrid.engine.sampling import SamplingParams
from colibrid.policy import POLICIES, make_policy, simulate
from colibrid.policy.belady import belady_hits, fewest_reads
from colibrid.policy.gated import GatedLFRU
from colibrid.store import io_pool
from colibrid.store.budget import mem_available
from colibrid.store.extents import ALIGN
from colibrid.store.memwatch import MemWatch
from colibrid.store.options import StoreOptions
from colibrid.store.slabs import SlabArena

GiB = 1 << 30


def greedy(engine: Engine, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=20, temperature=0.0)
    return [e.token_id for e in generate(engine, prompt, params) if isinstance(e, TokenEvent)]


def tiered(ref, **kw) -> Engine:
    kw.setdefault("pin", "off")
    kw.setdefault("pilot", "off")
    return Engine.load(ref.out_dir, store=StoreOptions(mode="tiered", **kw))


def test_extents_are_aligned_and_slab_is_aligned(oracle_checkpoint) -> None:
    engine = tiered(oracle_checkpoint("glm4_moe"), cache=2)
    try:
        store = engine.experts
        for row in store.extents.values():
            for ext in row:
                assert ext.reads and ext.slab_bytes <= store.slot_bytes
                for r in ext.reads:
                    assert r.offset % ALIGN == 0 and r.length % ALIGN == 0
                    assert r.slab_offset % ALIGN == 0
        assert store.reader.arena.buf.ctypes.data % ALIGN == 0
        assert store.files.mode == "O_DIRECT"  # tmp_path is ext4 here: direct really works
    finally:
        engine.close()


def test_direct_fallback_is_reported(oracle_checkpoint, monkeypatch, caplog) -> None:
    monkeypatch.setattr(io_pool, "_probe_direct", lambda fd, size: "Invalid argument")
    ref = oracle_checkpoint("glm4_moe")
    engine = tiered(ref, cache=1)
    try:
        assert engine.experts.files.mode.startswith("buffered (direct I/O unsupported")
        assert "direct I/O not available" in caplog.text
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()


def _zipf_trace(rows: int, width: int, seed: int = 0) -> list[list[int]]:
    hot = np.random.default_rng(seed).zipf(1.3, size=(rows, width)) % 32
    return [sorted(set(row.tolist())) for row in hot]


@pytest.mark.parametrize("width", [4, 16])  # one request's experts, or a batch's union
def test_policies_never_beat_belady(width: int) -> None:
    trace = _zipf_trace(400, width)
    for cap in (1, 2, 4, 8):
        best, n = belady_hits(trace, cap)
        for name in POLICIES:
            hits, m = simulate(make_policy(name), trace, cap)
            assert m == n and hits <= best, (name, cap)


def _fewest_by_search(trace: list[list[int]], keys: int, capacity: int) -> int:
    """The true optimum by exhaustive search: any starting content, and after each step
    any `capacity` of what was cached or just read (a relaxation of the store's rule)."""
    from itertools import combinations

    def subsets(pool: set[int]) -> list[frozenset[int]]:
        return [frozenset(c) for c in combinations(sorted(pool), min(capacity, len(pool)))]

    best = {state: 0 for state in subsets(set(range(keys)))}
    for step in trace:
        nxt: dict[frozenset[int], int] = {}
        for state, cost in best.items():
            cost += len(set(step) - state)
            for after in subsets(set(state) | set(step)):
                nxt[after] = min(nxt.get(after, cost), cost)
        best = nxt
    return min(best.values())


def test_fewest_reads_bounds_every_cache_from_any_start() -> None:
    """`bench batch` prints it as the limit of a cache policy: never above the optimum of a
    cache that starts with the best possible content (the bench's decode window starts
    warm), and exact where the warm start is all the difference."""
    assert fewest_reads([[1], [2], [1], [2]], 1) == 2  # start holding 1: read 2 twice
    rng = np.random.default_rng(3)
    for _ in range(30):
        trace = [sorted(set(rng.integers(0, 5, size=2).tolist())) for _ in range(7)]
        for cap in (1, 2):
            assert fewest_reads(trace, cap) <= _fewest_by_search(trace, 5, cap), (trace, cap)


def test_simulate_keeps_a_steps_hits() -> None:
    """The store protects what a step hit until the step is over: its misses may only
    displace each other, so the next step hits the same experts again."""
    hits, lookups = simulate(make_policy("lru"), [[1, 2], [1, 2, 3, 4], [1, 2]], 2)
    assert (hits, lookups) == (4, 8)


def test_gated_lfru_keeps_a_hot_expert_from_a_cold_read() -> None:
    policy = GatedLFRU()
    for _ in range(5):
        policy.seen(7)  # used (missed) five times before it was cached
    policy.admit(7)
    policy.seen(3)
    assert not policy.admits(3, 7)  # one use does not displace five
    for _ in range(5):
        policy.seen(3)
    assert policy.admits(3, 7)  # six recent uses do
    lfru = make_policy("lfru")
    lfru.admit(7)
    assert lfru.admits(3, 7)  # plain LFRU admits every read


def test_gated_lfru_reads_less_on_skewed_routing() -> None:
    trace = _zipf_trace(400, 4, seed=1)
    for cap in (1, 2, 4):
        gated, n = simulate(make_policy("gated-lfru"), trace, cap)
        plain, _ = simulate(make_policy("lfru"), trace, cap)
        assert gated > plain, (cap, gated, plain, n)


def test_slab_release_and_fault_in() -> None:
    arena = SlabArena(5000, 3)
    arena.slot(1)[:] = 7
    arena.release(1)
    assert arena.slot(1).max() == 0 and arena.slot(0).shape[0] == arena.slot_bytes
    arena.fault_in(1)


def test_fault_in_many_gives_every_slot_its_pages() -> None:
    from colibrid.store.memwatch import mapping_rss

    arena = SlabArena(1 << 20, 12, prefault=False)
    start = arena.buf.ctypes.data
    before = mapping_rss(start, start + arena.nbytes)
    if before is None:
        pytest.skip("no /proc/self/smaps here")
    assert before < arena.nbytes // 2
    arena.fault_in_many(range(12), threads=3)
    assert mapping_rss(start, start + arena.nbytes) >= arena.nbytes
    for i in range(12):
        arena.release(i)
    assert mapping_rss(start, start + arena.nbytes) < arena.nbytes // 2


def test_background_fault_in_keeps_contents_and_passes_over_skipped_slots() -> None:
    """The start-up fault-in runs beside the reads that fill slots: it must give every
    slot its pages without changing a byte already written, and leave a slot that was
    parked meanwhile without pages (memory stays bounded). /proc's RSS is per mapping and
    a transparent huge page may straddle two slots, hence 8 MiB slots and a 4 MiB margin."""
    from colibrid.store.memwatch import mapping_rss

    slot, n = 8 << 20, 12
    arena = SlabArena(slot, n, prefault=False)
    start = arena.buf.ctypes.data
    if mapping_rss(start, start + arena.nbytes) is None:
        pytest.skip("no /proc/self/smaps here")
    arena.slot(5)[:] = 9  # a read that landed before the fault-in reached its slot
    thread = arena.fault_in_background(range(n), skip=lambda i: i == 7)
    if thread is None:  # no MADV_POPULATE_WRITE: faulted in by touching, before returning
        assert not arena.populate(0)
        assert mapping_rss(start, start + arena.nbytes) >= arena.nbytes
    else:
        thread.join(timeout=60)
        assert not thread.is_alive()
        rss = mapping_rss(start, start + arena.nbytes)
        assert arena.nbytes - slot <= rss <= arena.nbytes - slot + (4 << 20), rss
    assert arena.slot(5).min() == 9 and arena.slot(5).max() == 9
    arena.stop_background()


def test_memwatch_shrinks_and_grows_between_tokens(oracle_checkpoint) -> None:
    ref = oracle_checkpoint("glm4_moe")
    engine = tiered(ref, cache=16)
    store = engine.experts
    free = [100 * GiB]
    store.memwatch = MemWatch(
        low=GiB, band=1, available=lambda: free[0], rss=lambda: 0, sample_thread=False
    )
    try:
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
        assert store.cache_per_layer == 16
        free[0] = GiB // 2
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
        assert store.cache_per_layer == 0 and store.placement.parked
        assert all(not c for c in store.placement.cache.values())
        free[0] = 100 * GiB
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
        assert store.cache_per_layer == 16 and not store.placement.parked
        assert "grow" in store.statistics().memwatch
    finally:
        engine.close()


HOG = """
import mmap, sys
m = mmap.mmap(-1, int(sys.argv[1]))
for i in range(0, len(m), 4096):
    m[i] = 1
print("held", flush=True)
sys.stdin.read()
"""


def test_memwatch_follows_another_process(oracle_checkpoint) -> None:
    """Another process takes 1.5 GiB during a generation: the cache shrinks, tokens stay
    identical, and it grows back once that memory is released."""
    ref = oracle_checkpoint("glm4_moe")
    engine = tiered(ref, cache=16)
    store = engine.experts
    store.memwatch.close()
    # Margins of 1.5 GiB either way, so other processes on a shared machine moving a few
    # hundred MB cannot decide the outcome; resizes happen between tokens, so generate
    # until the watcher has acted (bounded).
    store.memwatch = MemWatch(low=mem_available() - int(1.5 * GiB), band=64 << 20, interval_s=0.05)
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG, str(3 * GiB)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == b"held"
        for _ in range(10):
            time.sleep(0.2)
            assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
            if store.cache_per_layer < 16:
                break
        assert store.cache_per_layer < 16
        hog.kill()
        hog.wait()
        for _ in range(10):
            time.sleep(0.2)
            assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
            if store.cache_per_layer == 16:
                break
        assert store.cache_per_layer == 16
        assert [a.split()[0] for a in store.memwatch.actions][:1] == ["shrink"]
        assert store.memwatch.actions[-1].startswith("grow")
    finally:
        hog.kill()
        engine.close()


def test_statistics_split_and_per_request(oracle_checkpoint) -> None:
    ref = oracle_checkpoint("glm4_moe")
    engine = tiered(ref, cache=4, io_threads=2)
    try:
        greedy(engine, ref.prompt_ids)
        st = engine.experts.statistics()
        assert st.lookups == st.hits_pinned + st.hits_cache + st.hits_prefetched + st.misses
        assert st.bytes_read > 0 and st.tokens == 20 and st.io_mode == "O_DIRECT"
        assert 0 < st.hit_rate < 1 and st.read_gb_s > 0
        assert any("hit" in line for line in st.lines())
        # the time split: attention measured by the model, experts and I/O by the store
        assert st.attention_s > 0 and st.compute_s > 0 and st.other_s >= 0
        assert any(f"attention {st.attention_s:.3f} s" in line for line in st.lines())
    finally:
        engine.close()


@pytest.mark.parametrize("pin", ["all", "auto"])
def test_profile_and_pins_do_not_change_tokens(oracle_checkpoint, tmp_path, pin) -> None:
    ref = oracle_checkpoint("deepseek_v3")
    profile = tmp_path / ".coli_usage"
    engine = tiered(ref, cache=2, profile=str(profile))
    try:
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()
    assert profile.read_text().startswith("-1 ")
    engine = tiered(ref, cache=2 if pin == "all" else None, ram_gb=4, pin=pin, profile=str(profile))
    try:
        if pin == "all":
            assert engine.experts.pinned
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
        st = engine.experts.statistics()
        assert st.hits_pinned > 0 or pin == "auto"
    finally:
        engine.close()


def test_repin_swaps_in_the_background_without_changing_tokens(oracle_checkpoint) -> None:
    ref = oracle_checkpoint("deepseek_v3")
    engine = tiered(ref, cache=2, io_threads=2, pin="all", ram_gb=4)
    try:
        store = engine.experts
        layer = store.layers[0]
        greedy(engine, ref.prompt_ids)  # learn which experts this prompt uses
        used = store.counts[layer]
        cold = int(np.argmin(used))
        hot = int(np.argmax(used))
        assert used[hot] > used[cold] * 1.25 + 4
        only_cold = np.zeros_like(store.counts)
        only_cold[layer, cold] = 1
        assert store.apply_pins(only_cold) == 1  # one pin: the cold expert
        store.recorder.heat[:] = 0
        np.add.at(store.recorder.heat[layer], np.repeat(np.arange(len(used)), used), 1.0)
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids  # ends with request_finished
        # the swap was decided at the boundary: the cold expert left the pinned tier at
        # once, the hot one is pinned or on its way (a background read nobody waits for)
        assert (layer, cold) not in store.pinned
        assert (layer, hot) in store.pinned or (layer, hot) in store.placement.pin_on_land
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
        assert (layer, hot) in store.pinned and not store.placement.pin_on_land
        assert store.statistics().hits_pinned > 0
        # not cached any more: the promotion must read, and repin() must not wait for it
        store.set_cache_per_layer(0)
        store.set_cache_per_layer(2)
        second = int(np.argsort(used)[-2])
        store.moves.repin((layer, hot), (layer, second))
        assert (layer, second) in store.placement.pin_on_land and (
            layer,
            second,
        ) not in store.pinned
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
        assert (layer, second) in store.pinned and not store.placement.pin_on_land
    finally:
        engine.close()


def test_a_dropped_delivery_lands_its_reads_and_frees_their_slots(oracle_checkpoint) -> None:
    ref = oracle_checkpoint("glm4_moe")
    engine = tiered(ref, cache=1, io_threads=2)
    try:
        store = engine.experts
        layer = store.layers[0]
        free0 = len(store.placement.free)
        store.iter_ready(layer, [0, 1, 2])  # lookup and reads happen here; never iterated
        assert len(store.placement.free) == free0 - 3
        assert [e for e, _ in store.iter_ready(layer, [1])] == [1]  # cleans up, then serves
        assert len(store.placement.free) == free0 - 1 and list(store.placement.cache[layer]) == [1]
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()


def land_guesses(store) -> None:
    """Let every background read in flight land (completions taken, not yet placed)."""
    deadline = time.monotonic() + 10
    pilot = store.prefetcher
    while (pilot.inflight or pilot.stopping) and time.monotonic() < deadline:
        store.completions.poll()


def test_landed_guesses_are_used_even_when_the_cache_is_smaller(oracle_checkpoint) -> None:
    ref = oracle_checkpoint("glm4_moe")
    engine = tiered(ref, cache=1, io_threads=2, pilot="on")
    try:
        store = engine.experts
        layer = store.layers[0]
        assert store.hint(layer, [2, 0, 1]) == 3
        land_guesses(store)
        before = store.stats.copy()
        assert [e for e, _ in store.iter_ready(layer, [0, 1, 2])] == [0, 1, 2]
        st = store.statistics(since=before)
        assert st.hits_prefetched == 3 and st.misses == 0 and st.bytes_read == 0
        assert len(store.placement.cache[layer]) == 1  # kept what fits, after use
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()


def test_a_guess_read_twice_before_its_layer_runs_is_kept_once(oracle_checkpoint) -> None:
    """A guess that landed (not yet placed) is not in flight any more, so the next token's
    PILOT may read it again; the layer must use one copy and free the other (a leaked
    HELD slot here once shrank the store under load)."""
    ref = oracle_checkpoint("glm4_moe")
    engine = tiered(ref, cache=1, io_threads=2, pilot="on")
    try:
        store = engine.experts
        layer = store.layers[0]
        for _ in range(2):
            assert store.hint(layer, [3]) == 1
            land_guesses(store)  # lands it without placing it
        assert len(store.completions.landed) == 2
        assert [e for e, _ in store.iter_ready(layer, [3])] == [3]
        store.check_consistency()
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()


def test_a_guess_that_found_no_room_starts_once_the_layer_before_is_looked_up(
    oracle_checkpoint,
) -> None:
    """Layer L+1 is guessed before layer L is looked up, while L's guesses hold PILOT's
    slots; what found no room starts right after L's lookup placed L's guesses, so L+1
    finds it read instead of missing (before, every other layer got only the slots its
    predecessor's guesses left)."""
    ref = oracle_checkpoint("glm4_moe")
    engine = tiered(ref, cache=1, io_threads=2, pilot="on")
    try:
        store = engine.experts
        first, second = store.layers[:2]
        room = store.placement.pilot_room
        n_experts = store.layout.n_experts
        assert 2 <= room <= n_experts
        assert store.hint(first, list(range(room))) == room  # every PILOT slot taken
        assert store.hint(second, [0, 1]) == 0  # nothing left for the next layer
        land_guesses(store)
        loads = store.stats.pilot_loads
        assert [e for e, _ in store.iter_ready(first, [0])] == [0]  # the lookup frees them
        assert store.stats.pilot_loads == loads + 2  # the second layer's guess started
        land_guesses(store)
        before = store.stats.copy()
        assert [e for e, _ in store.iter_ready(second, [0, 1])] == [0, 1]
        st = store.statistics(since=before)
        assert st.hits_prefetched == 2 and st.misses == 0 and st.bytes_read == 0
        store.check_consistency()
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()


def test_a_wrong_guess_already_running_is_stopped_when_its_layer_chooses_others(
    oracle_checkpoint,
) -> None:
    """A guess a reader thread has started cannot be withdrawn; when its layer chooses
    other experts it is stopped instead: its slot comes back free, its unread bytes are
    not counted, it never reaches a cache, and the tokens stay the oracle's."""
    import threading

    ref = oracle_checkpoint("glm4_moe")
    engine = tiered(ref, cache=1, io_threads=2, pilot="on")
    try:
        store = engine.experts
        layer = store.layers[0]
        files = store.pool.files
        real, running, release = files.read_into, threading.Event(), threading.Event()

        def held(batch, target, stop=None):  # noqa: ANN001, ANN202
            if stop is not None:  # the guess: running until the layer has chosen
                running.set()
                assert release.wait(timeout=10)
            return real(batch, target, stop)

        files.read_into = held
        free0 = len(store.placement.free)
        before = store.stats.copy()
        assert store.hint(layer, [3]) == 1
        assert running.wait(timeout=10)
        assert [e for e, _ in store.iter_ready(layer, [0])] == [0]  # the layer chose 0
        assert (layer, 3) not in store.prefetcher.inflight and store.prefetcher.stopping
        release.set()
        land_guesses(store)
        st = store.statistics(since=before)
        assert st.pilot_stopped == 1 and st.pilot_cancelled == 0
        assert st.bytes_read == store.extents[layer][0].read_bytes  # the demand read only
        assert 3 not in store.placement.cache[layer]
        assert len(store.placement.free) == free0 - 1  # only expert 0, now cached
        store.check_consistency()
        files.read_into = real
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        release.set()
        engine.close()
