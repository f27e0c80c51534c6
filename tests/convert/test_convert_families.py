"""`colibri convert` of the softmax-routed families (Qwen3-MoE, Mixtral, OLMoE) and of an
FP8 DeepSeek-V3.2 checkpoint: the container's routed experts are int8 or int4-g64,
everything else f32, and the engine on it reproduces transformers run on the dequantised
weights, token for token.

The source folder holds the original f32 experts (Mixtral's under their own names,
``block_sparse_moe.experts.E.w1/w3/w2``); the reference used quantise-then-dequantise of
them, computed with the independent numpy maths of quant_reference.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tiny_models
from quant_reference import EXACT_FLAGS, encoding, int4_roundtrip, ref_dequant, ref_quant

from colibri_cli.main import main
from colibrid.backends.base import KernelFamily
from colibrid.convert.inspect import inspect
from colibrid.engine.engine import Engine
from colibrid.engine.generate import DoneEvent, TokenEvent, generate, teacher_forced_argmax
from colibrid.engine.sampling import SamplingParams
from colibrid.formats.weights import WeightFormat

BITS = {"int8": (8, WeightFormat.Q8, "int8-row"), "int4-g64": (4, WeightFormat.Q4, "int4-g64")}


def greedy(engine: Engine, prompt: list[int], n: int = 20) -> list[int]:
    events = list(generate(engine, prompt, SamplingParams(max_tokens=n, temperature=0.0)))
    assert isinstance(events[-1], DoneEvent)
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


@pytest.mark.parametrize("fmt", sorted(BITS))
@pytest.mark.parametrize("arch", tiny_models.SOFTMAX_ARCHS)
def test_converted_family_matches_dequantised_reference(
    oracle_checkpoint, tmp_path: Path, arch: str, fmt: str
) -> None:
    bits, weight_format, stored = BITS[fmt]
    gs = 64 if bits == 4 else 0

    def roundtrip(name: str, w: np.ndarray) -> np.ndarray:
        data, scales = ref_quant(w, bits, gs)
        return ref_dequant(data, scales, w.shape, bits, gs).astype(np.float32)

    ref = oracle_checkpoint(
        arch, "f32", expert_transform=roundtrip, expert_container=lambda name, w: {name: w}
    )
    dst = tmp_path / "container"
    assert main(["convert", str(ref.out_dir), str(dst), "--bits", str(bits), *EXACT_FLAGS]) == 0

    report = inspect(dst)
    config = tiny_models.tiny_config(arch)
    n_routed = 3 * tiny_models.n_experts(config) * len(tiny_models.moe_layer_indices(config))
    assert report.formats["expert"] == {stored: n_routed}
    assert set(report.formats["f32"]) == {"f32"}  # norms and the router stay f32
    assert report.expert_contiguous  # an expert's three matrices are one read

    engine = Engine.load(dst, family=KernelFamily.F32)
    try:
        layer = engine.experts.layout.moe_layers[0]
        assert engine.experts.get(layer, 0).gate.fmt == weight_format
        assert teacher_forced_argmax(engine, ref.tf_ids) == ref.tf_pred
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()


def test_deepseek_v32_fp8_checkpoint_converts(oracle_checkpoint, tmp_path: Path) -> None:
    """DeepSeek-V3.2 ships FP8 e4m3 weights with 128x128 block scales, as V3 does: every
    linear but the embedding, head, router and the indexer's weights_proj (the indexer's
    wq_b and wk included). The converter decodes them; experts become int4-g64, the rest f32
    (EXACT_FLAGS), and the engine reproduces transformers on those weights."""
    container, decode = encoding("fp8")
    ref = oracle_checkpoint(
        "deepseek_v32",
        "fp8",
        expert_transform=lambda name, w: int4_roundtrip(decode(w)),
        expert_container=container,
    )
    stored = {name: dtype for name, dtype, _, _ in tiny_models.tensor_table(ref.out_dir)}
    indexer = "model.layers.1.self_attn.indexer."
    assert stored[indexer + "wq_b.weight"] == stored[indexer + "wk.weight"] == "F8_E4M3"
    assert stored[indexer + "weights_proj.weight"] == "F32"
    assert stored["model.layers.2.mlp.experts.3.down_proj.weight"] == "F8_E4M3"

    dst = tmp_path / "container"
    assert main(["convert", str(ref.out_dir), str(dst), *EXACT_FLAGS]) == 0
    report = inspect(dst)
    config = tiny_models.tiny_config("deepseek_v32")
    n_routed = 3 * config.n_routed_experts * len(tiny_models.moe_layer_indices(config))
    assert report.formats["expert"] == {"int4-g64": n_routed}
    assert set(report.formats["f32"]) == {"f32"}
    engine = Engine.load(dst, family=KernelFamily.F32)
    try:
        assert not engine.args.indexer.interleave
        assert teacher_forced_argmax(engine, ref.tf_ids) == ref.tf_pred
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()


def test_mixtral_names_are_classified() -> None:
    from colibrid.convert.plan import classify, expert_of

    name = "model.layers.3.block_sparse_moe.experts.5.w3.weight"
    assert expert_of(name) == (3, 5, "up_proj")
    assert expert_of(name.replace("w3", "w1")) == (3, 5, "gate_proj")
    assert expert_of(name.replace("w3", "w2")) == (3, 5, "down_proj")
    assert expert_of(name.replace("w3", "w4")) is None
    assert classify(name, (16, 8), 4) == "expert"
    assert classify("model.layers.3.block_sparse_moe.gate.weight", (8, 16), 4) == "f32"
    assert classify("model.layers.3.mlp.experts.5.gate_proj.weight", (16, 8), 4) == "expert"
