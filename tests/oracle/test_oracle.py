"""The engine reproduces transformers token for token on tiny random checkpoints.

Per architecture (the four sigmoid-routed DeepSeek-style families and the three
softmax-routed ones: Qwen3-MoE, Mixtral with a sliding window, OLMoE): 32/32
teacher-forced argmax (one batched prefill) and 20/20 greedy tokens (prefill + decode
with the KV cache), at f32, from bf16 and FP8 checkpoints (against the reference on the
rounded / dequantised weights), and with routed experts quantised in-process to int8 and
int4-g64 colibri container tensors (against the reference on the dequantised expert
weights).
"""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import tiny_models

from colibrid.backends.base import KernelFamily
from colibrid.engine.engine import Engine
from colibrid.engine.generate import DoneEvent, TokenEvent, generate, teacher_forced_argmax
from colibrid.engine.sampling import SamplingParams
from colibrid.formats.quant import container_tensors, dequantize, quantize
from colibrid.formats.weights import WeightFormat
from colibrid.models.transformer import planned_cache_layouts


def greedy(engine: Engine, prompt: list[int], n: int = 20) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0.0)
    events = list(generate(engine, prompt, params))
    assert isinstance(events[-1], DoneEvent)
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def check_against_reference(ref: tiny_models.OracleReference) -> None:
    engine = Engine.load(ref.out_dir, family=KernelFamily.F32)
    try:
        tf = teacher_forced_argmax(engine, ref.tf_ids)
        assert tf == ref.tf_pred, f"teacher-forced {sum(map(int.__eq__, tf, ref.tf_pred))}/32"
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()


@pytest.mark.parametrize("arch", tiny_models.ARCHS)
@pytest.mark.parametrize("dtype", ["f32", "bf16", "fp8"])
def test_matches_transformers(oracle_checkpoint, arch: str, dtype: str) -> None:
    check_against_reference(oracle_checkpoint(arch, dtype))


@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_planned_cache_layouts_match_the_built_model(oracle_checkpoint, arch: str) -> None:
    """The KV budget the expert store is planned around is read from the config before
    the model exists; it must be what the built model then caches, layer by layer (DSA
    layers with and without their own indexer, sliding windows, MLA and GQA alike)."""
    engine = Engine.load(oracle_checkpoint(arch).out_dir)
    try:
        planned = planned_cache_layouts(engine.args, engine.checkpoint)
        assert planned == engine.model.cache_layouts()
    finally:
        engine.close()


QUANT_FORMATS = {"int8": (WeightFormat.Q8, 0), "int4-g64": (WeightFormat.Q4, 64)}


@pytest.mark.parametrize("arch", tiny_models.ARCHS)
@pytest.mark.parametrize("fmt", sorted(QUANT_FORMATS))
def test_quantised_experts_match_dequantised_reference(
    oracle_checkpoint, arch: str, fmt: str
) -> None:
    weight_format, group_size = QUANT_FORMATS[fmt]

    def roundtrip(name: str, w: np.ndarray) -> np.ndarray:
        return dequantize(quantize(w, weight_format, group_size))

    def as_container(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
        return container_tensors(name, quantize(w, weight_format, group_size))

    ref = oracle_checkpoint(arch, "f32", expert_transform=roundtrip, expert_container=as_container)
    engine = Engine.load(ref.out_dir)
    try:
        layer = engine.experts.layout.moe_layers[0]
        assert engine.experts.get(layer, 0).gate.fmt == weight_format
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()


def test_glm5_indexer_really_selects(oracle_checkpoint) -> None:
    """The GLM-5 fixture keeps fewer keys than the context holds, so DSA is exercised."""
    ref = oracle_checkpoint("glm_moe_dsa")
    engine = Engine.load(ref.out_dir)
    try:
        assert engine.args.indexer.topk < len(ref.tf_ids)
        assert "shared" in engine.args.indexer_types
    finally:
        engine.close()


def test_v32_indexer_selects_on_every_layer(oracle_checkpoint) -> None:
    """DeepSeek-V3.2 has no "shared" layers: every layer, the MTP layer included, runs its own
    indexer, with rotate_half RoPE, and keeps fewer keys than the context holds."""
    ref = oracle_checkpoint("deepseek_v32")
    engine = Engine.load(ref.out_dir)
    try:
        assert engine.args.indexer.topk < len(ref.tf_ids) and not engine.args.indexer.interleave
        assert all(layer.attention.indexer is not None for layer in engine.model.layers)
        assert engine.model.mtp.decoder.attention.indexer is not None
        assert all("index_k" in layout for layout in engine.model.cache_layouts())
    finally:
        engine.close()


def test_mixtral_window_really_cuts(oracle_checkpoint) -> None:
    """The Mixtral fixture's sliding window is shorter than the prompt, so the engine's
    windowed attention is exercised by prefill and decode alike."""
    ref = oracle_checkpoint("mixtral")
    engine = Engine.load(ref.out_dir)
    try:
        window = engine.args.attention.window
        assert window is not None and window < len(ref.prompt_ids) < len(ref.tf_ids)
        assert all(layer.attention.block.window == window for layer in engine.model.layers)
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32", "deepseek_v3"])
def test_mtp_layer_is_loaded(oracle_checkpoint, arch: str) -> None:
    ref = oracle_checkpoint(arch)
    engine = Engine.load(ref.out_dir)
    try:
        mtp = engine.model.mtp
        assert mtp is not None and mtp.index == engine.args.trunk.num_hidden_layers
        # loaded, but not run until speculation uses it: its experts are not the store's
        assert mtp.index not in engine.experts.layout.moe_layers
        hidden = np.ones((1, engine.args.trunk.hidden_size), dtype=np.float32)
        out = mtp.input(hidden, hidden, KernelFamily.F32)
        assert out.shape == hidden.shape and np.isfinite(out).all()
    finally:
        engine.close()


@pytest.mark.parametrize("arch", tiny_models.SOFTMAX_ARCHS)
def test_softmax_router_ignores_a_stray_selection_bias(oracle_checkpoint, tmp_path, arch) -> None:
    """`e_score_correction_bias` belongs to the sigmoid router: a softmax checkpoint that
    carries one (an earlier synthetic container did) still routes as transformers does."""
    from safetensors.numpy import load_file, save_file

    ref = oracle_checkpoint(arch)
    folder = tmp_path / "model"
    shutil.copytree(ref.out_dir, folder)
    shard = folder / "model.safetensors"
    tensors = load_file(str(shard))
    router = re.compile(r"model\.layers\.\d+\.\w+\.(gate|router)\.weight")
    routers = [name for name in tensors if router.fullmatch(name)]
    assert routers
    for name in routers:
        bias = np.zeros(tensors[name].shape[0], dtype=np.float32)
        bias[0] = 100.0  # would put expert 0 in every row's choice
        tensors[name.removesuffix("weight") + "e_score_correction_bias"] = bias
    save_file(tensors, str(shard), metadata={"format": "pt"})
    engine = Engine.load(folder)
    try:
        assert engine.model.layers[0].mlp.router.bias is None
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()
