"""Auto mode's choice between resident and streamed experts, made from headers alone
before any extent is planned (store/options.py)."""

from __future__ import annotations

import pytest

from colibrid.engine.engine import expert_layout
from colibrid.formats import quant
from colibrid.formats.weights import WeightFormat
from colibrid.models import family
from colibrid.store.budget import GiB
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.experts import expert_tensor_names
from colibrid.store.options import StoreOptions, open_store, split_bytes
from colibrid.store.resident import ResidentExpertStore
from colibrid.store.tiered import TieredStore


def int4_experts(name, w):
    return quant.container_tensors(name, quant.quantize(w, WeightFormat.Q4, group_size=64))


@pytest.mark.parametrize(("arch", "container"), [("glm4_moe", None), ("deepseek_v3", int4_experts)])
def test_auto_streams_exactly_when_everything_exceeds_half_the_budget(
    oracle_checkpoint, arch, container
):
    """The rule's expert bytes are the tiered store's planned payload (with .qs scales in
    a container), and the boundary is half the budget, to the byte."""
    ref = oracle_checkpoint(arch, expert_container=container)
    with Checkpoint.open(ref.out_dir) as ck:
        args = family(ck.config["model_type"]).ModelArgs.from_config(ck.config)
        layout = expert_layout(args, ck, with_mtp=False)
        planned = TieredStore(ck, layout, direct=False, io_threads=0)
        dense, experts = split_bytes(ck, expert_tensor_names(layout))
        assert experts == planned.payload_bytes() > 0  # the rule counts what streaming plans
        planned.close()
        everything = dense + experts
        for budget, kind in (
            (2 * everything + 4, ResidentExpertStore),
            (2 * everything - 4, TieredStore),
        ):
            store = open_store(ck, layout, StoreOptions(ram_gb=budget / GiB), arch)
            try:
                assert isinstance(store, kind), (budget, everything)
            finally:
                store.close()
