"""The device tier's policy (backends/device_tier.py), on any copy function: expert weights
are kept by the RAM cache's rule (gated LFRU), dense weights always. What it keeps only
changes what is copied, never what is computed: the cuda and mlx tests check that side."""

from __future__ import annotations

import gc

import numpy as np

from colibrid.backends.device_tier import DeviceTier
from colibrid.formats.quant import quantize
from colibrid.formats.weights import QuantWeight, WeightFormat
from colibrid.policy.gated import GatedLFRU, HeatGatedLFRU
from colibrid.policy.lru import LRU


def _weight(seed: int, rows: int = 16) -> QuantWeight:
    w = np.random.default_rng(seed).standard_normal((rows, 64), dtype=np.float32)
    return quantize(w, WeightFormat.Q4, 64)


def _tier(budget: int | None, policy=None) -> DeviceTier[int]:  # noqa: ANN001
    return DeviceTier(lambda w: w.nbytes, lambda size: size, budget, policy)


def _decode(tier: DeviceTier[int], hot: list[QuantWeight], tokens: int) -> None:
    """Each token uses every hot expert weight (what RAM holds for good) and two weights
    seen once (streamed experts: a new view per read), interleaved."""
    for t in range(tokens):
        for n, w in enumerate(hot):
            tier.get(w, expert=True)
            if n % 2:
                tier.get(_weight(1000 + t * 100 + n), expert=True)  # dies right after


def test_streamed_experts_pass_through_and_the_hot_ones_stay() -> None:
    hot = [_weight(s) for s in range(4)]
    tier = _tier(budget=4 * hot[0].nbytes)
    _decode(tier, hot, tokens=3)  # heat builds: the first tokens' reads still get in
    stats = tier.stats
    copies, passed, hits = stats.copies, stats.passed, stats.hits
    _decode(tier, hot, tokens=10)
    assert stats.copies - copies == stats.passed - passed == 20  # only the streamed ones
    assert stats.hits - hits == 40  # every hot use served from the tier
    assert stats.expert_weights == 4 and stats.bytes <= stats.budget


def test_least_recently_used_would_copy_the_hot_experts_every_token() -> None:
    """The contrast that makes the policy matter: the same trace under LRU."""
    hot = [_weight(s) for s in range(4)]
    tier = _tier(budget=4 * hot[0].nbytes, policy=LRU())
    _decode(tier, hot, tokens=10)
    assert tier.stats.passed == 0 and tier.stats.copies > 40


def test_a_hotter_expert_displaces_a_colder_one() -> None:
    a, b, c = _weight(1), _weight(2), _weight(3)
    tier = _tier(budget=2 * a.nbytes)
    for _ in range(3):
        tier.get(a, expert=True)
        tier.get(b, expert=True)
    for _ in range(2):
        tier.get(c, expert=True)  # colder than a and b: passes through
    assert tier.stats.passed == 2
    for _ in range(6):
        tier.get(c, expert=True)  # now the hottest: takes the colder one's place
    assert tier.stats.passed < 8 and tier.stats.expert_weights == 2
    hits = tier.stats.hits
    tier.get(c, expert=True)
    assert tier.stats.hits == hits + 1


def test_dense_weights_are_always_kept_room_made_from_experts() -> None:
    experts = [_weight(s) for s in range(3)]
    dense = _weight(9, rows=32)  # twice an expert weight
    tier = _tier(budget=3 * experts[0].nbytes)
    for _ in range(5):
        for w in experts:
            tier.get(w, expert=True)
    tier.get(dense)
    assert tier.stats.weights == 2 and tier.stats.expert_weights == 1
    tier.get(dense)
    assert tier.stats.hits == 4 * 3 + 1 and tier.stats.bytes <= tier.stats.budget


def test_a_dead_weight_takes_its_copy_and_its_heat() -> None:
    policy = GatedLFRU()
    tier = _tier(budget=None, policy=policy)
    w = _weight(5)
    for _ in range(3):
        tier.get(w, expert=True)
    key = id(w)
    assert tier.stats.expert_weights == 1
    del w
    gc.collect()
    assert tier.stats.expert_weights == 0 and tier.stats.bytes == 0
    assert policy.score(key) >> 8 == 0  # no heat: an id reused later starts cold


def test_a_dead_weight_that_only_passed_through_takes_its_heat() -> None:
    """A weight the tier never kept (no room: the caller computed it on the host, as an
    I8 expert with host_experts does) still leaves heat in the policy; when it dies that
    heat goes too, or a later weight given its id would be kept by its uses."""
    policy = GatedLFRU()
    held = _weight(6)
    tier = _tier(budget=held.nbytes, policy=policy)
    for _ in range(5):
        assert tier.keep(held) is not None  # the budget's one weight, hot
    w = _weight(7)
    for _ in range(3):
        assert tier.keep(w) is None  # colder than the held one: passed, never copied
    key = id(w)
    assert policy.score(key) >> 8 > 0
    del w
    gc.collect()
    assert policy.score(key) >> 8 == 0


def test_promotion_copies_the_hottest_that_fit_and_evicts_nothing() -> None:
    held = [_weight(s) for s in range(2)]
    ranked = [_weight(10 + s) for s in range(5)]  # a profile's order, hottest first
    tier = _tier(budget=4 * held[0].nbytes)
    for w in held:
        tier.get(w, expert=True)
    assert tier.promote(ranked) == 2  # the two hottest fit beside what is held
    assert tier.stats.expert_weights == 4 and tier.stats.copies == 4
    hits = tier.stats.hits
    for w in [*held, *ranked[:2]]:
        tier.get(w, expert=True)
    assert tier.stats.hits == hits + 4  # all four served from the tier
    assert tier.promote(ranked) == 0  # full: nothing evicted for a promotion
    assert _tier(budget=None).promote(ranked) == 0  # no budget: copies come at first use


def test_the_heat_gate_finds_its_victim_as_a_scan_would() -> None:
    """HeatGatedLFRU's heap (stale entries, rebuilds at each decay) against a scan for the
    least (heat, last use) resident, over random uses, admissions, removals and deaths."""
    rng = np.random.default_rng(3)
    policy = HeatGatedLFRU(decay_every=50)
    resident: set[int] = set()
    last: dict[int, int] = {}
    for step in range(3000):
        key, op = int(rng.integers(0, 40)), int(rng.integers(0, 10))
        if op < 5:
            (policy.touch if key in resident else policy.seen)(key)
            last[key] = step
        elif op < 8 and key not in resident:
            policy.seen(key)
            policy.admit(key)
            resident.add(key)
            last[key] = step
        elif op == 8:
            policy.remove(key)
            resident.discard(key)
        else:
            policy.forget(key)
            resident.discard(key)
            last.pop(key, None)
        protected = {int(k) for k in rng.integers(0, 40, 3)}
        candidates = [k for k in resident if k not in protected]
        want = min(candidates, key=lambda k: (policy.heat(k), last[k]), default=None)
        assert policy.victim(protected) == want
