"""The softmax-routed families read config.json as transformers does (which layers are MoE,
where the window applies, what defaults mean) and refuse what the engine cannot compute,
with one line naming the key."""

from __future__ import annotations

from typing import Any

import pytest
import tiny_models

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
    ],
)
def test_unsupported_configs_are_refused_by_key(arch: str, changes: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        args_of(arch, **changes)
    message = str(info.value)
    assert f"({arch})" in message and f"'{key}'" in message and "\n" not in message
