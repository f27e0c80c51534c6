"""The oracle fixtures are sane: reloadable, reproducible, and exercise the hard paths."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny_models as tm
import torch
from safetensors import safe_open

ALL = [(a, d) for a in tm.ARCHS for d in tm.DTYPES]


def _tf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _greedy(model, prompt):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=tm.GEN_LEN, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def _dtypes(folder):
    return {name: dt for name, dt, _, _ in tm.tensor_table(folder)}


@pytest.mark.parametrize("arch,dtype", ALL)
def test_reload_reproduces_reference(oracle_checkpoint, arch, dtype):
    ref = oracle_checkpoint(arch, dtype)
    assert len(ref.prompt_ids) == tm.PROMPT_LEN
    assert len(ref.greedy_ids) == tm.GEN_LEN
    assert len(ref.tf_ids) == len(ref.tf_pred) == tm.TF_LEN
    on_disk = json.loads((ref.out_dir / "oracle.json").read_text())
    assert on_disk["greedy_ids"] == ref.greedy_ids and on_disk["tf_pred"] == ref.tf_pred
    assert on_disk["transformers_version"] == "5.24.0"
    model = tm.load_reference_model_any(ref.out_dir)
    logits = _tf_logits(model, ref.tf_ids)
    np.testing.assert_allclose(logits.numpy(), ref.tf_logits, atol=1e-4, rtol=0)
    assert logits.argmax(-1).tolist() == ref.tf_pred
    assert _greedy(model, ref.prompt_ids) == ref.greedy_ids


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_tokens_are_varied(oracle_checkpoint, arch):
    ref = oracle_checkpoint(arch)
    assert len(set(ref.greedy_ids)) >= 8, ref.greedy_ids
    assert len(set(ref.tf_pred)) >= 12, ref.tf_pred


@pytest.mark.parametrize("arch,dtype", ALL)
def test_no_near_ties(oracle_checkpoint, arch, dtype):
    """Argmax, expert and DSA selections are robust to float32 summation-order noise."""
    ref = oracle_checkpoint(arch, dtype)
    assert ref.tf_logits_top2_gap > 1e-4
    assert ref.greedy_logits_top2_gap > 1e-4
    d = ref.diagnostics
    assert d["router_min_margin"] > 1e-6
    if d["router_group_min_margin"] is not None:
        assert d["router_group_min_margin"] > 1e-6
    if arch in tm.DSA_ARCHS:
        assert d["dsa_rows_selecting"] > 0
        assert d["dsa_min_topk_gap"] > 1e-6


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_routing_is_nontrivial(oracle_checkpoint, arch):
    ref = oracle_checkpoint(arch)
    cfg = tm.tiny_config(arch)
    d = ref.diagnostics
    assert d["moe_layers"] == tm.moe_layer_indices(cfg)
    for layer in d["moe_layers"]:
        assert d["distinct_expert_sets_tf"][str(layer)] >= 10
        assert d["experts_used_tf"][str(layer)] >= tm.n_experts(cfg) // 2
    if arch in ("glm_moe_dsa", "deepseek_v32", "deepseek_v3"):
        assert 1 < cfg.topk_group < cfg.n_group


def test_group_limited_routing_matters(oracle_checkpoint):
    """With n_group=1 the same weights route (and predict) differently."""
    for arch in ("glm_moe_dsa", "deepseek_v32", "deepseek_v3"):
        ref = oracle_checkpoint(arch)
        model = tm.load_reference_model(ref.out_dir)
        base = _tf_logits(model, ref.tf_ids)
        cfg = tm.tiny_config(arch, n_group=1, topk_group=1)
        other = _tf_logits(tm.load_reference_model(ref.out_dir, config=cfg), ref.tf_ids)
        assert (base - other).abs().max() > 1e-3, arch


@pytest.mark.parametrize("arch", tm.DSA_ARCHS)
def test_dsa_indexer_drops_keys(oracle_checkpoint, arch):
    ref = oracle_checkpoint(arch)
    cfg = tm.tiny_config(arch)
    assert cfg.index_topk < tm.PROMPT_LEN < tm.TF_LEN
    sparse = _tf_logits(tm.load_reference_model(ref.out_dir), ref.tf_ids)
    dense_cfg = tm.tiny_config(arch, index_topk=4096)
    dense = _tf_logits(tm.load_reference_model(ref.out_dir, config=dense_cfg), ref.tf_ids)
    k = cfg.index_topk
    # positions 0..k-1 see at most k keys: the indexer keeps them all
    torch.testing.assert_close(sparse[:k], dense[:k], atol=1e-5, rtol=0)
    # later positions lose keys
    assert (sparse[k:] - dense[k:]).abs().max() > 1e-2
    assert sparse.argmax(-1).tolist() != dense.argmax(-1).tolist()


def test_bf16_files_hold_bf16(oracle_checkpoint):
    for arch in tm.ARCHS:
        ref = oracle_checkpoint(arch, "bf16")
        for name, dt in _dtypes(ref.out_dir).items():
            want = "F32" if name.endswith("e_score_correction_bias") else "BF16"
            assert dt == want, (arch, name, dt)


def test_fp8_files_hold_fp8_blocks(oracle_checkpoint):
    for arch in tm.ARCHS:
        ref = oracle_checkpoint(arch, "fp8")
        cfg = json.loads((ref.out_dir / "config.json").read_text())
        assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
        rows = tm.tensor_table(ref.out_dir)
        table = {name: (dt, shape) for name, dt, shape, _ in rows}
        files = {name: f for name, _, _, f in rows}
        fp8 = [n for n, (dt, _) in table.items() if dt == "F8_E4M3"]
        layer = tm.moe_layer_indices(tm.tiny_config(arch))[0]
        assert tm.expert_names(arch, layer, 3)[2] in fp8
        if arch in tm.SIGMOID_ARCHS:
            assert any(".mlp.shared_experts.gate_proj.weight" in n for n in fp8)
        assert any(".self_attn.o_proj.weight" in n for n in fp8)
        for n in fp8:
            o, i = table[n][1]
            s_dt, s_shape = table[n + "_scale_inv"]
            assert s_dt == "F32" and s_shape == (-(-o // 128), -(-i // 128)), n
        if any(max(table[n][1]) > 128 for n in fp8):  # multi-block weights (not gpt-oss's)
            assert any(table[n + "_scale_inv"][1] != (1, 1) for n in fp8)
        for n, (dt, _) in table.items():
            if n.endswith(
                (
                    "embed_tokens.weight",
                    "lm_head.weight",
                    "mlp.gate.weight",
                    "block_sparse_moe.gate.weight",
                    "norm.weight",
                    ".bias",
                    "e_score_correction_bias",
                )
            ):
                assert dt == "F32", (arch, n, dt)
        # scales are small and non-trivial
        with safe_open(str(ref.out_dir / files[fp8[0]]), framework="pt") as fh:
            s = fh.get_tensor(fp8[0] + "_scale_inv")
        assert 0 < float(s.min()) and float(s.max()) < 0.1


def test_saved_layout_per_expert(oracle_checkpoint):
    for arch in tm.SIGMOID_ARCHS:
        ref = oracle_checkpoint(arch)
        cfg = tm.tiny_config(arch)
        table = {name: shape for name, _, shape, _ in tm.tensor_table(ref.out_dir)}
        assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in table)
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        for layer in range(1, cfg.num_hidden_layers + 1):  # incl. the MTP layer
            for e in range(cfg.n_routed_experts):
                p = f"model.layers.{layer}.mlp.experts.{e}."
                assert table[p + "gate_proj.weight"] == (i, h)
                assert table[p + "up_proj.weight"] == (i, h)
                assert table[p + "down_proj.weight"] == (h, i)
            assert table[f"model.layers.{layer}.mlp.gate.weight"] == (cfg.n_routed_experts, h)
            assert table[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] == (
                cfg.n_routed_experts,
            )
        assert table["model.layers.0.mlp.gate_proj.weight"] == (cfg.intermediate_size, h)


@pytest.mark.parametrize("arch", tm.SOFTMAX_ARCHS)
def test_saved_layout_softmax_archs(oracle_checkpoint, arch):
    """Per-expert names as the real checkpoints have them (Mixtral's block_sparse_moe
    w1/w3/w2; gpt-oss as colibri convert splits its fused experts), one file, no shared
    expert, no correction bias, no MTP layer."""
    ref = oracle_checkpoint(arch)
    cfg = tm.tiny_config(arch)
    rows = tm.tensor_table(ref.out_dir)
    table = {name: shape for name, _, shape, _ in rows}
    assert {f for _, _, _, f in rows} == {"model.safetensors"}
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in table)
    assert not any("shared_expert" in n or "correction_bias" in n for n in table)
    assert not any(n.startswith(f"model.layers.{cfg.num_hidden_layers}.") for n in table)
    h, i, n = cfg.hidden_size, tm.expert_width(cfg), tm.n_experts(cfg)
    moe = tm.moe_layer_indices(cfg)
    for layer in moe:
        for e in range(n):
            gate, up, down = tm.expert_names(arch, layer, e)
            assert table[gate] == table[up] == (i, h) and table[down] == (h, i)
        assert table[tm.router_name(arch, layer)] == (n, h)
    experts = [name for name in table if tm.is_routed_expert(name)]
    assert len(experts) == 3 * n * len(moe)
    for layer in set(range(cfg.num_hidden_layers)) - set(moe):  # Qwen3-MoE's dense layers
        assert table[f"model.layers.{layer}.mlp.gate_proj.weight"] == (cfg.intermediate_size, h)
    if arch == "olmoe":  # qk-norm over the whole projections
        d = h // cfg.num_attention_heads
        assert table["model.layers.0.self_attn.q_norm.weight"] == (h,)
        assert table["model.layers.0.self_attn.k_norm.weight"] == (cfg.num_key_value_heads * d,)
    if arch == "qwen3_moe":  # qk-norm per head
        assert table["model.layers.0.self_attn.q_norm.weight"] == (cfg.head_dim,)
    if arch == "gpt_oss":  # sinks, router bias, the fused expert biases
        assert table["model.layers.0.self_attn.sinks"] == (cfg.num_attention_heads,)
        assert table["model.layers.0.mlp.router.bias"] == (n,)
        assert table["model.layers.0.mlp.experts.gate_up_proj_bias"] == (n, 2 * i)
        assert table["model.layers.0.mlp.experts.down_proj_bias"] == (n, h)


def test_mixtral_window_drops_keys(oracle_checkpoint):
    """The Mixtral fixture's sliding window is shorter than the prompt: the first `window`
    positions are unaffected, later ones lose keys (and predictions change)."""
    ref = oracle_checkpoint("mixtral")
    cfg = tm.tiny_config("mixtral")
    window = cfg.sliding_window
    assert window < tm.PROMPT_LEN < tm.TF_LEN
    windowed = _tf_logits(tm.load_reference_model(ref.out_dir), ref.tf_ids)
    full_cfg = tm.tiny_config("mixtral", sliding_window=None)
    full = _tf_logits(tm.load_reference_model(ref.out_dir, config=full_cfg), ref.tf_ids)
    torch.testing.assert_close(windowed[:window], full[:window], atol=1e-5, rtol=0)
    assert (windowed[window:] - full[window:]).abs().max() > 1e-2
    assert windowed.argmax(-1).tolist() != full.argmax(-1).tolist()


@pytest.mark.parametrize("arch", tm.MTP_ARCHS)
def test_mtp_shard(oracle_checkpoint, arch):
    ref = oracle_checkpoint(arch)
    n = ref.num_hidden_layers
    index = json.loads((ref.out_dir / tm.INDEX_FILE).read_text())
    table = tm.tensor_table(ref.out_dir)
    assert {name: f for name, _, _, f in table} == index["weight_map"]
    assert not (ref.out_dir / "model.safetensors").exists()
    mtp = {name for name, _, _, f in table if f == tm.MTP_SHARD}
    assert mtp == {k for k in index["weight_map"] if k.startswith(f"model.layers.{n}.")}
    for k in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "embed_tokens.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "mlp.gate.weight",
        "mlp.experts.0.up_proj.weight",
        "mlp.shared_experts.down_proj.weight",
        "self_attn.o_proj.weight",
    ):
        assert f"model.layers.{n}.{k}" in mtp, k
    if arch in tm.DSA_ARCHS:
        assert f"model.layers.{n}.self_attn.indexer.wk.weight" in mtp
    cfg = json.loads((ref.out_dir / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    # transformers ignores the MTP layer: same logits as a checkpoint without it
    plain = oracle_checkpoint(arch, with_mtp=False)
    assert not (plain.out_dir / tm.INDEX_FILE).exists()
    assert plain.greedy_ids == ref.greedy_ids and plain.tf_pred == ref.tf_pred
    np.testing.assert_array_equal(plain.tf_logits, ref.tf_logits)
    model = tm.load_reference_model(ref.out_dir)
    np.testing.assert_array_equal(_tf_logits(model, ref.tf_ids).numpy(), ref.tf_logits)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_mtp_naming_loads_in_transformers_mtp_model(oracle_checkpoint, arch):
    """transformers' own MtpModel loader accepts the shard (it raises on any missing key)."""
    from transformers.modeling_layers import MtpModel

    ref = oracle_checkpoint(arch)
    n = ref.num_hidden_layers
    model = tm.load_reference_model(ref.out_dir)
    # the class-level pattern names the real layer index (61 / 46 / 92); point it at ours
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\..*"]
    mtp = MtpModel.from_pretrained(model)
    with safe_open(str(ref.out_dir / tm.MTP_SHARD), framework="pt") as fh:
        assert torch.equal(
            mtp.layers[0].eh_proj.weight, fh.get_tensor(f"model.layers.{n}.eh_proj.weight")
        )
        assert torch.equal(
            mtp.layers[0].post_norm.weight,
            fh.get_tensor(f"model.layers.{n}.shared_head.norm.weight"),
        )
        assert torch.equal(
            mtp.layers[0].mtp_block.mlp.experts.down_proj[5],
            fh.get_tensor(f"model.layers.{n}.mlp.experts.5.down_proj.weight"),
        )


def test_expert_transform_and_container(oracle_checkpoint):
    seen = []

    def transform(name, w):
        seen.append(name)
        return np.round(w * 8.0) / 8.0

    def container(name, w):
        return {
            name: np.zeros(w.shape, dtype=np.uint8),
            name + ".qs": np.ones(w.shape[0], np.float32),
        }

    base = oracle_checkpoint("deepseek_v3")
    ref = oracle_checkpoint("deepseek_v3", expert_transform=transform)
    cfg = tm.tiny_config("deepseek_v3")
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert len(seen) == 3 * cfg.n_routed_experts * n_moe
    assert all(tm.is_routed_expert(n) and ".layers.3." not in n for n in seen)  # MTP untouched
    # the transform reached the reference
    assert np.abs(ref.tf_logits - base.tf_logits).max() > 1e-3
    model = tm.load_reference_model(ref.out_dir)  # stored values are the transformed ones
    np.testing.assert_allclose(
        _tf_logits(model, ref.tf_ids).numpy(), ref.tf_logits, atol=1e-4, rtol=0
    )
    assert _greedy(model, ref.prompt_ids) == ref.greedy_ids

    both = oracle_checkpoint("deepseek_v3", expert_transform=transform, expert_container=container)
    assert both.greedy_ids == ref.greedy_ids and both.tf_pred == ref.tf_pred
    table = {name: (dt, shape) for name, dt, shape, _ in tm.tensor_table(both.out_dir)}
    name = "model.layers.1.mlp.experts.7.gate_proj.weight"
    assert table[name] == ("U8", (cfg.moe_intermediate_size, cfg.hidden_size))
    assert table[name + ".qs"] == ("F32", (cfg.moe_intermediate_size,))
    assert table["model.layers.1.mlp.shared_experts.gate_proj.weight"][0] == "F32"


def test_gpt_oss_fixture_exercises_its_features(oracle_checkpoint):
    """Each gpt-oss feature the engine must get right changes the reference's logits on the
    fixture: the attention sinks, the window (shorter than the prompt, on the sliding
    layers only), the SwiGLU clamp, and the router and expert biases."""
    ref = oracle_checkpoint("gpt_oss")
    cfg = tm.tiny_config("gpt_oss")
    window = cfg.sliding_window
    assert window < tm.PROMPT_LEN < tm.TF_LEN
    assert cfg.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    base = _tf_logits(tm.load_reference_model_any(ref.out_dir), ref.tf_ids)

    def changed(edit=None, **config) -> torch.Tensor:
        model = tm.load_reference_model_any(ref.out_dir, tm.tiny_config("gpt_oss", **config))
        if edit is not None:
            with torch.no_grad():
                for layer in model.model.layers:
                    edit(layer)
        return (_tf_logits(model, ref.tf_ids) - base).abs()

    full = changed(layer_types=["full_attention"] * cfg.num_hidden_layers)
    assert full[:window].max() < 1e-5 and full[window:].max() > 1e-2
    assert changed(lambda m: m.self_attn.sinks.fill_(-1e4)).max() > 1e-2
    assert changed(swiglu_limit=1e6).max() > 1e-2
    assert changed(lambda m: m.mlp.router.bias.zero_()).max() > 1e-2
    assert changed(lambda m: m.mlp.experts.gate_up_proj_bias.zero_()).max() > 1e-2
    assert changed(lambda m: m.mlp.experts.down_proj_bias.zero_()).max() > 1e-2
