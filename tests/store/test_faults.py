"""A failure is contained (docs/architecture.md): a fault injected at any point of a pass — the
first layer's reads, the middle of a layer's deliveries, a model bug after some experts
ran, PILOT's background reads or its hint, a REPIN read, a cancel — fails that request
only; the store's bookkeeping stays whole and the next request's tokens equal a fresh
store's."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from colibrid.engine.engine import Engine
from colibrid.engine.generate import TokenEvent, generate
from colibrid.engine.sampling import SamplingParams
from colibrid.errors import Cancelled, ColibriError
from colibrid.store import io_pool
from colibrid.store.options import StoreOptions

PARAMS = SamplingParams(max_tokens=20, temperature=0.0)


def greedy(engine: Engine, prompt: list[int], cancel: threading.Event | None = None) -> list[int]:
    events = generate(engine, prompt, PARAMS, cancel=cancel)
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


class Boom(RuntimeError):
    """The injected fault."""


def after(n: int, fn, exc: BaseException):
    """``fn`` that raises ``exc`` on its ``n``-th call (1-based), then works again."""
    calls = [0]

    def wrapped(*a, **kw):
        calls[0] += 1
        if calls[0] == n:
            raise exc
        return fn(*a, **kw)

    return wrapped


@pytest.fixture(scope="module")
def ref(oracle_checkpoint):
    return oracle_checkpoint("deepseek_v3")


@pytest.fixture()
def engine(ref):
    opts = StoreOptions(mode="tiered", cache=1, pin="all", pilot="on", io_threads=2, ram_gb=4)
    engine = Engine.load(ref.out_dir, store=opts)
    counts = np.zeros(engine.experts.counts.shape, dtype=np.int64)
    for layer in engine.experts.layers:  # a few pins, so pinned, cached and read all mix
        counts[layer, :2] = 1
    engine.experts.apply_pins(counts)
    yield engine
    engine.close()


def fails_then_recovers(engine: Engine, ref, match=None) -> None:
    with pytest.raises((ColibriError, Boom), match=match):
        greedy(engine, ref.prompt_ids)
    engine.experts.check_consistency()
    assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    engine.experts.check_consistency()


def fail_reads(pool, priority: int, nth: int | None = None) -> None:
    """Reads of ``priority`` complete with an I/O error: the ``nth`` one only, or all."""
    real_submit, calls = pool.submit, [0]

    def submit(tag, reads, target, prio=io_pool.DEMAND_READ, check=None):
        if prio == priority:
            calls[0] += 1
            if nth is None or calls[0] == nth:
                pool.done.put((tag, 0, OSError(5, "injected I/O error")))
                return
        real_submit(tag, reads, target, prio, check)

    pool.submit = submit


@pytest.mark.parametrize("nth", [1, 3, 9])  # the first read, early, and mid-prefill
def test_a_read_error_fails_one_request(engine, ref, nth) -> None:
    fail_reads(engine.experts.reader.pool, io_pool.DEMAND_READ, nth)
    fails_then_recovers(engine, ref, match="injected I/O error")


@pytest.mark.parametrize("nth", [1, 2, 7])  # first expert of the first layer, mid-layer, later
def test_a_bug_between_experts_fails_one_request(engine, ref, nth) -> None:
    ops = engine.model.layers[-1].mlp.ops
    ops.expert_swiglu = after(nth, ops.expert_swiglu, Boom("injected bug"))
    try:
        fails_then_recovers(engine, ref)
    finally:
        del ops.expert_swiglu  # the instance attribute shadowed the method


def test_a_failing_pilot_hint_and_failing_background_reads(engine, ref) -> None:
    store = engine.experts
    pilot = store.prefetcher
    real_hint = pilot.hint
    calls = [0]

    def hint_then_fail(layer, experts, room):
        calls[0] += 1
        issued = real_hint(layer, experts, room)  # reads really start, then the bug
        if calls[0] == 2:
            raise Boom("injected PILOT bug")
        return issued

    pilot.hint = hint_then_fail
    with pytest.raises(Boom):
        greedy(engine, ref.prompt_ids)
    pilot.hint = real_hint
    store.check_consistency()
    # every background read fails from now on: guesses cost nothing but themselves
    fail_reads(store.reader.pool, io_pool.BACKGROUND)
    assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    store.check_consistency()
    assert store.statistics().pilot_loads > 0


def test_a_failing_repin_read(engine, ref) -> None:
    store = engine.experts
    assert greedy(engine, ref.prompt_ids) == ref.greedy_ids  # learn session heat
    layer = store.layers[0]
    cold = next(k for k in store.pinned_keys() if k[0] == layer)
    hot = (layer, next(e for e in range(store.layout.n_experts) if (layer, e) not in store.pinned))
    store.set_cache_per_layer(0)  # not cached: the promotion must read
    store.set_cache_per_layer(1)
    fail_reads(store.reader.pool, io_pool.BACKGROUND, 1)  # REPIN reads at background priority
    store.moves.repin(cold, hot)
    assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    store.check_consistency()
    assert hot not in store.pinned and not store.placement.pin_on_land


class CancelAt(threading.Event):
    """A cancel flag that turns itself on at its ``n``-th check (checked between layers)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def is_set(self) -> bool:
        self.left -= 1
        return self.left < 0 or super().is_set()


@pytest.mark.parametrize("layer", [1, 2])
def test_a_cancel_between_layers(engine, ref, layer) -> None:
    with pytest.raises(Cancelled):
        engine.new_session().prefill(ref.prompt_ids, cancel=CancelAt(layer))
    engine.experts.check_consistency()
    assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
