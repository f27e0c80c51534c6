"""The softmax-routed families and the DSA families (DeepSeek-V3.2, GLM-5) read config.json
as transformers does (which layers are MoE, where the window applies, the indexer's shape and
RoPE layout, what defaults mean) and refuse what the engine cannot compute, with one line
naming the key."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tiny_models
import transformers

from colibrid.errors import ConfigError
from colibrid.models import family


def args_of(arch: str, **changes: Any) -> Any:
    config = tiny_models.tiny_config(arch).to_dict()
    config.update(changes)
    return family(arch).ModelArgs.from_config(config)


def test_qwen3_dense_layers_follow_mlp_only_layers_and_the_sparse_step() -> None:
    assert args_of("qwen3_moe").is_moe == (True, True, False, True)
    assert args_of("qwen3_moe", mlp_only_layers=[], decoder_sparse_step=2).is_moe == (
        False,
        True,
        False,
        True,
    )
    assert args_of("qwen3_moe", mlp_only_layers=None).is_moe == (True,) * 4


def test_qwen3_window_only_with_use_sliding_window() -> None:
    assert args_of("qwen3_moe", sliding_window=16).attention.window is None
    on = args_of("qwen3_moe", sliding_window=16, use_sliding_window=True)
    assert on.attention.window == 16


def test_qwen3_attention_shape_and_routing() -> None:
    args = args_of("qwen3_moe", attention_bias=True)
    a, moe = args.attention, args.moe
    assert (a.heads, a.kv_heads, a.head_dim) == (4, 2, 48) and args.rotary_dim == 48
    assert a.qk_norm and not a.qk_norm_whole and a.bias and a.o_bias
    assert moe.softmax and moe.norm_topk_prob and moe.n_shared_experts == 0
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 64)
    no_key = tiny_models.tiny_config("qwen3_moe").to_dict()
    del no_key["norm_topk_prob"]
    assert not family("qwen3_moe").ModelArgs.from_config(no_key).moe.norm_topk_prob


def test_mixtral_names_window_and_renormalised_top_k() -> None:
    args = args_of("mixtral", norm_topk_prob=False)  # not a Mixtral key: always renormalised
    a, moe = args.attention, args.moe
    assert a.head_dim == 32 and args.rotary_dim == 32  # head_dim null: hidden / heads
    assert a.window == 8 and not a.qk_norm and not a.bias and not a.o_bias
    assert moe.norm_topk_prob and moe.softmax and moe.moe_intermediate_size == 192
    assert moe.module == "block_sparse_moe" and moe.expert_names == ("w1", "w3", "w2")
    assert args.is_moe == (True,) * 3
    assert args_of("mixtral", sliding_window=None).attention.window is None


def test_gpt_oss_reads_its_layers_biases_and_activation() -> None:
    args = args_of("gpt_oss")
    a, moe = args.attention, args.moe
    assert a.sinks and a.bias and a.o_bias and not a.qk_norm and a.head_dim == 32
    assert args.windows == (8, None, 8)  # GptOssConfig's alternation, sliding first
    assert args.is_moe == (True,) * 3 and moe.n_shared_experts == 0
    assert moe.router == "router" and moe.router_bias and moe.norm_topk_prob and moe.softmax
    assert moe.moe_intermediate_size == 96 and moe.num_experts_per_tok == 2
    assert moe.glu is not None and (moe.glu.alpha, moe.glu.limit) == (1.702, 1.5)
    mixed = args_of("gpt_oss", layer_types=["full_attention"] * 2 + ["sliding_attention"])
    assert mixed.windows == (None, None, 8)
    assert args_of("gpt_oss", layer_types=None).windows == (8, None, 8)


def test_gpt_oss_defaults_are_gptossconfigs() -> None:
    """A hand-written config without the optional keys means what GptOssConfig means."""
    config = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_local_experts": 8,
    }
    args = family("gpt_oss").ModelArgs.from_config(config)
    assert args.attention.head_dim == 64 and args.attention.kv_heads == 8
    assert args.trunk.rms_norm_eps == 1e-5 and args.windows == (128, None)
    assert args.moe.num_experts_per_tok == 4 and args.moe.glu.limit == 7.0
    assert args.rope["rope_type"] == "yarn" and args.rope["rope_theta"] == 150000.0
    assert args.rope["factor"] == 32.0 and args.rope["truncate"] is False


def test_olmoe_norms_span_the_whole_projections() -> None:
    args = args_of("olmoe")
    a = args.attention
    assert a.qk_norm and a.qk_norm_whole and a.head_dim == 32 and a.window is None
    assert not args.moe.norm_topk_prob and args.moe.n_routed_experts == 8


def _without(arch: str, *keys: str) -> dict[str, Any]:
    config = tiny_models.tiny_config(arch).to_dict()
    for key in keys:
        del config[key]
    return config


INDEX_KEYS = ("index_n_heads", "index_head_dim", "index_topk")


@pytest.mark.parametrize(
    "arch,config_class,interleave",
    [("deepseek_v32", "DeepseekV32Config", False), ("glm_moe_dsa", "GlmMoeDsaConfig", True)],
)
def test_dsa_indexer_defaults_and_rope_layout(arch: str, config_class: str, interleave: bool):
    """A config without the index keys means transformers' defaults (V3.2: 64 index heads,
    GLM-5: 32; both 128 dims and top-2048); the indexer's RoPE layout is the family's,
    while the MLA interleaves in both whatever `rope_interleave` says."""
    defaults = getattr(transformers, config_class)()
    args = family(arch).ModelArgs.from_config(_without(arch, *INDEX_KEYS))
    ix = args.indexer
    assert (ix.heads, ix.head_dim, ix.topk) == tuple(getattr(defaults, k) for k in INDEX_KEYS)
    assert ix.interleave is interleave and args.attention.interleave
    flipped = args_of(arch, rope_interleave=False)
    assert flipped.indexer.interleave is interleave and flipped.attention.interleave
    assert (flipped.indexer.heads, flipped.indexer.head_dim, flipped.indexer.topk) == (8, 32, 8)
    assert flipped.indexer.rope == flipped.attention.rope == 16


def test_v32_mla_moe_and_dense_layers() -> None:
    """DeepSeek-V3's MLA and sigmoid routing; dense layers from `mlp_layer_types`, else
    the first `first_k_dense_replace` (default 3, as transformers' DeepseekV32Config)."""
    args = args_of("deepseek_v32")
    a, moe = args.attention, args.moe
    assert (a.heads, a.q_lora_rank, a.kv_lora_rank, a.nope, a.rope, a.v) == (4, 96, 64, 32, 16, 32)
    assert not moe.softmax and (moe.n_group, moe.topk_group, moe.n_shared_experts) == (4, 2, 1)
    assert moe.routed_scaling_factor == 2.5 and args.is_moe == (False, True, True)
    config = _without("deepseek_v32", "mlp_layer_types", "first_k_dense_replace")
    assert family("deepseek_v32").ModelArgs.from_config(config).is_moe == (False,) * 3
    assert args_of("deepseek_v32", mlp_layer_types=["sparse"] * 3).is_moe == (True,) * 3


@pytest.mark.parametrize(
    "arch,changes,key",
    [
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
        ("olmoe", {"head_dim": 16}, "head_dim"),
        ("mixtral", {"sliding_window": 0}, "sliding_window"),
        ("qwen3_moe", {"mlp_only_layers": ["2"]}, "mlp_only_layers"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act"),
        ("mixtral", {"num_key_value_heads": 3}, "num_key_value_heads"),
        ("olmoe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("deepseek_v32", {"q_lora_rank": None}, "q_lora_rank"),
        ("deepseek_v32", {"index_head_dim": 8}, "index_head_dim"),
        ("deepseek_v32", {"index_n_heads": 0}, "index_n_heads"),
        ("deepseek_v32", {"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
        ("deepseek_v32", {"n_group": 3}, "n_group"),
        ("gpt_oss", {"layer_types": ["sliding_attention", "chunked"]}, "layer_types"),
        ("gpt_oss", {"swiglu_limit": -1.0}, "swiglu_limit"),
        ("gpt_oss", {"sliding_window": 0}, "sliding_window"),
    ],
)
def test_unsupported_configs_are_refused_by_key(arch: str, changes: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        args_of(arch, **changes)
    message = str(info.value)
    assert f"({arch})" in message and f"'{key}'" in message and "\n" not in message


# gpt-oss-20b's config.json as released (quantization_config shortened): the legacy
# `rope_scaling` key, top-level `rope_theta`, an `experts_per_token` alias transformers ignores.
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "pad_token_id": 199999,
    "quantization_config": {"quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}


def test_gpt_oss_20b_config_and_its_yarn_match_transformers() -> None:
    import torch
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from colibrid.models.layers.rope import Rotary

    args = family("gpt_oss").ModelArgs.from_config(GPT_OSS_20B)
    assert args.windows == (128, None) * 12 and args.moe.n_routed_experts == 32
    assert (args.attention.heads, args.attention.kv_heads, args.attention.head_dim) == (64, 8, 64)
    rotary = Rotary(64, args.rope, max_positions=args.trunk.max_position_embeddings)
    config = transformers.GptOssConfig(
        **{k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"}
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    np.testing.assert_allclose(rotary.inv_freq, inv_freq.numpy(), rtol=1e-6)
    assert rotary.attention_factor == pytest.approx(factor)
