"""Placement never changes tokens (docs/architecture.md): every store configuration gives the same
bytes as the all-resident store, for every tiny oracle architecture.

One checkpoint per arch; each configuration loads once and runs a 32-token teacher-forced
prefill (the batch-union path: many experts per layer) and 20 greedy tokens (decode).
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import tiny_models

from colibrid.engine.engine import Engine
from colibrid.engine.generate import TokenEvent, generate
from colibrid.engine.sampling import SamplingParams
from colibrid.formats.quant import container_tensors, dequantize, quantize
from colibrid.formats.weights import WeightFormat
from colibrid.store.options import StoreOptions
from colibrid.store.tiered import TieredStore

CACHES = (1, 2, 8, None)  # None: every expert of a layer fits (cache == n_experts)
CONFIGS = [
    dict(cache=c, io_threads=t, direct=d, pilot="off")
    for c, t, d in itertools.product(CACHES, (4, 0), (True, False))
]
CONFIGS += [
    dict(cache=c, io_threads=t, direct=True, pilot="on")
    for c, t in itertools.product(CACHES, (4, 0))
]


def run(ref: tiny_models.OracleReference, opts: StoreOptions | None) -> tuple[bytes, list[int]]:
    engine = Engine.load(ref.out_dir, store=opts)
    try:
        logits = np.asarray(engine.new_session().prefill(ref.tf_ids, all_logits=True))
        params = SamplingParams(max_tokens=20, temperature=0.0)
        ids = [
            e.token_id
            for e in generate(engine, ref.prompt_ids, params)
            if isinstance(e, TokenEvent)
        ]
        if opts is not None and opts.mode == "tiered":
            assert isinstance(engine.experts, TieredStore)
            st = engine.experts.statistics()
            assert st.lookups > 0
            if opts.cache == 1:
                assert st.misses > st.hits_cache  # eviction on (nearly) every expert
            if opts.pilot == "on":
                assert st.pilot_recall is not None and st.pilot_loads > 0
        return logits.tobytes(), ids
    finally:
        engine.close()


def n_experts(ref: tiny_models.OracleReference) -> int:
    """Routed experts per layer, under whichever key the architecture's config uses."""
    config = json.loads((ref.out_dir / "config.json").read_text())
    for key in ("n_routed_experts", "num_local_experts", "num_experts"):
        if config.get(key) is not None:
            return int(config[key])
    raise KeyError("no expert count in config.json")


def check_all(ref: tiny_models.OracleReference, n_experts: int) -> None:
    want_logits, want_ids = run(ref, StoreOptions(mode="resident"))
    assert want_ids == ref.greedy_ids
    for cfg in CONFIGS:
        cache = n_experts if cfg["cache"] is None else cfg["cache"]
        opts = StoreOptions(
            mode="tiered",
            cache=cache,
            io_threads=cfg["io_threads"],
            direct=cfg["direct"],
            pin="off",
            pilot=cfg["pilot"],
        )
        logits, ids = run(ref, opts)
        assert ids == want_ids, cfg
        assert logits == want_logits, cfg


@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_f32_experts_every_placement_is_identical(oracle_checkpoint, arch: str) -> None:
    ref = oracle_checkpoint(arch)
    check_all(ref, n_experts(ref))


@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_int4_container_experts_every_placement_is_identical(oracle_checkpoint, arch: str) -> None:
    """U8 data and F32 .qs scales sit in different regions of the file: several extents."""

    def roundtrip(name: str, w: np.ndarray) -> np.ndarray:
        return dequantize(quantize(w, WeightFormat.Q4, 64))

    def as_container(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
        return container_tensors(name, quantize(w, WeightFormat.Q4, 64))

    ref = oracle_checkpoint(arch, "f32", expert_transform=roundtrip, expert_container=as_container)
    check_all(ref, n_experts(ref))


def test_union_larger_than_work_slots_streams_through(oracle_checkpoint) -> None:
    """A prefill union of up to 16 experts through 2 work slots and a cache of 1."""
    ref = oracle_checkpoint("glm4_moe")
    want, _ = run(ref, StoreOptions(mode="resident"))
    engine = Engine.load(ref.out_dir, store=StoreOptions(mode="tiered", cache=1))
    try:
        store = engine.experts
        store.close()
        store.__init__(engine.checkpoint, store.layout, direct=True, io_threads=2)
        store.allocate(1, work_slots=2)
        logits = np.asarray(engine.new_session().prefill(ref.tf_ids, all_logits=True))
        assert logits.tobytes() == want
    finally:
        engine.close()
