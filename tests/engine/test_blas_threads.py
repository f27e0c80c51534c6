"""numpy's BLAS runs on one thread while the engine decodes (its spinning workers would
take the native kernels' cores), gets its thread count back for a long pass, and the
tokens are the oracle's either way."""

from __future__ import annotations

import pytest
from threadpoolctl import threadpool_info

from colibrid.engine.blas_threads import BLAS, DECODE_ROWS
from colibrid.engine.engine import Engine
from colibrid.engine.generate import TokenEvent, generate
from colibrid.engine.sampling import SamplingParams
from colibrid.store.options import StoreOptions


def blas_threads() -> list[int]:
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def test_decode_runs_blas_on_one_thread_and_a_long_pass_gets_its_threads_back(
    oracle_checkpoint,
) -> None:
    BLAS.before_pass(DECODE_ROWS + 1)  # whatever an earlier test left: the process's own
    original = blas_threads()
    if max(original, default=1) < 2:
        pytest.skip("numpy's BLAS has a single thread here: nothing to take off the cores")
    ref = oracle_checkpoint("glm4_moe")
    engine = Engine.load(ref.out_dir, store=StoreOptions(mode="tiered", pin="off", pilot="on"))
    try:
        params = SamplingParams(max_tokens=20, temperature=0.0)
        events = generate(engine, ref.prompt_ids, params)
        tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
        assert tokens == ref.greedy_ids
        assert blas_threads() == [1] * len(original)  # the last pass was a decode step
        BLAS.before_pass(DECODE_ROWS + 1)
        assert blas_threads() == original
    finally:
        engine.close()
