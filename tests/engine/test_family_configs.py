"""The softmax-routed families and the DSA families (DeepSeek-V3.2, GLM-5) read config.json
as transformers does (which layers are MoE, where the window applies, the indexer's shape and
RoPE layout, what defaults mean) and refuse what the engine cannot compute, with one line
naming the key."""

from __future__ import annotations

from typing import Any

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
    ],
)
def test_unsupported_configs_are_refused_by_key(arch: str, changes: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        args_of(arch, **changes)
    message = str(info.value)
    assert f"({arch})" in message and f"'{key}'" in message and "\n" not in message
