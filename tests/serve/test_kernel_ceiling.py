"""The kernel ceiling's work (serve.kernel_ceiling): the weight bytes it prices for one
decode token are the bytes the kernels are really handed by a decode token, counted by
`colibri bench decode`'s counting backend on a real tiny checkpoint — dense layers,
shared experts, top-k routed experts, the head, and no MTP layer that does not run."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.backends.base import KernelFamily
from colibrid.backends.cpu import CpuOps
from colibrid.backends.kernel_speed import layout_seconds_per_byte
from colibrid.bench.decode import CountingOps
from colibrid.engine.engine import Engine
from colibrid.serve.kernel_ceiling import kernel_tok_s, token_bytes
from colibrid.store.options import StoreOptions

STEPS = 3


@pytest.mark.parametrize("arch", ["glm4_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_the_bytes_priced_are_the_bytes_a_decode_token_multiplies(oracle_checkpoint, arch) -> None:
    ops = CountingOps(CpuOps())
    model = oracle_checkpoint(arch).out_dir
    engine = Engine.load(model, ops=ops, store=StoreOptions(mode="resident"), max_context=32)
    try:
        session = engine.new_session()
        logits = session.prefill([1, 2, 3, 4])
        ops.counting = True
        for _ in range(STEPS):
            logits = session.decode(int(np.argmax(logits)))
        ops.counting = False
        handed = sum(ops.by_shape.values()) / STEPS  # matrices only: no embedding row
        priced = token_bytes(engine)
        assert sum(priced.values()) == pytest.approx(handed, rel=1e-9), (priced, ops.by_shape)
        ceiling = kernel_tok_s(engine)  # timed, so only its sanity is asserted
        assert ceiling is not None and 0 < ceiling < float("inf")
        assert all(
            layout_seconds_per_byte(lay, rows, KernelFamily.F32) > 0
            for lay, rows in engine.checkpoint.matrix_layouts.items()
        )
    finally:
        engine.close()
