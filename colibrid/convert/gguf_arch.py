"""Which llama.cpp architecture a colibri model family is, its GGUF keys and tensor names.

Why a table and gguf-py's name map: llama.cpp names a tensor by its architecture's tensor
list (``blk.N.attn_q``, ``blk.N.ffn_gate_exps`` ...); the ``gguf`` package carries that map
for every architecture (``gguf.get_tensor_name_map``), so the checkpoint names colibri keeps
are translated by the library made for it, and only what the name map cannot know is
written here: the hyper-parameter keys each architecture reads, the experts stacked into
one 3-D tensor a layer, and the few tensors llama.cpp wants in another shape:

* MLA (deepseek2, glm-dsa, deepseek32): ``kv_b_proj`` is split per head into ``attn_k_b``
  (transposed) and ``attn_v_b``, the layout llama.cpp's absorbed attention reads. A
  transposed matrix has no block-exact form, so both are written as their f32 values.
* llama (Mixtral): llama.cpp rotates q/k pairs as interleaved (GPT-J) pairs where the
  checkpoint rotates halves, so the rows of ``q_proj``/``k_proj`` are reordered within
  each head (a row permutation: every stored row keeps its bytes).
* gpt-oss: the fused expert biases are split into gate (even) and up (odd) columns.

A family llama.cpp has no architecture for, or a model using what llama.cpp's architecture
lacks (a sliding window, dense layers in qwen3moe ...), is refused in one line naming it
(:func:`family_of`).
MTP layers are left out: llama.cpp's loaders of these architectures run without them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from colibrid.errors import ConvertError

Config = dict[str, Any]
Writer = Any  # gguf.GGUFWriter (imported lazily: gguf is needed only when exporting)

EXPERT = re.compile(
    r"^(model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight$"
)
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Family:
    """One colibri family as llama.cpp knows it."""

    model_type: str
    arch: str  # llama.cpp's architecture name (general.architecture)
    name_map: str  # the gguf.MODEL_ARCH member whose tensor names it uses
    metadata: Callable[[Writer, Config], None]
    check: Callable[[Config], str | None] = lambda cfg: None  # a refusal, or None


def _common(w: Writer, cfg: Config, head_dim: bool = True) -> None:
    """The keys every one of these architectures reads, named as in config.json (MLA
    writes its own key and value lengths: ``head_dim=False``)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_vocab_size(cfg["vocab_size"])
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts")
    w.add_expert_count(int(experts))
    w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    if head_dim and cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    _yarn(w, rope)


def _yarn(w: Writer, rope: Config) -> None:
    import gguf

    if rope.get("rope_type") != "yarn" or rope.get("factor") is None:
        return
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    for key, add in (
        ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
        ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
    ):
        if rope.get(key) is not None:
            add(float(rope[key]))
    if rope.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))


def _sigmoid_moe(w: Writer, cfg: Config) -> None:
    """DeepSeek-style routing: sigmoid scores, groups, shared experts, dense lead layers."""
    import gguf

    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg.get("n_shared_experts") or 0)
    w.add_leading_dense_block_count(cfg.get("first_k_dense_replace") or 0)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(float(cfg.get("routed_scaling_factor", 1.0)))
    w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", True)))
    if cfg.get("n_group"):
        w.add_expert_group_count(int(cfg["n_group"]))
        w.add_expert_group_used_count(int(cfg.get("topk_group") or 1))


def _glm4moe(w: Writer, cfg: Config) -> None:
    _common(w, cfg)
    _sigmoid_moe(w, cfg)
    rope = cfg.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    w.add_rope_dimension_count(int(cfg["head_dim"] * factor))


def _mla(w: Writer, cfg: Config) -> None:
    _common(w, cfg, head_dim=False)
    _sigmoid_moe(w, cfg)
    w.add_head_count_kv(1)  # the latent is one "head" shared by all (MQA)
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    kv, rope_dim = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    w.add_kv_lora_rank(kv)
    w.add_key_length(kv + rope_dim)
    w.add_value_length(kv)
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dim)
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_rope_dimension_count(rope_dim)


def _dsa(w: Writer, cfg: Config) -> None:
    _mla(w, cfg)
    w.add_indexer_head_count(cfg["index_n_heads"])
    w.add_indexer_key_length(cfg["index_head_dim"])
    w.add_indexer_top_k(cfg["index_topk"])
    if cfg.get("indexer_types") is not None:
        # (gguf-py 0.19 has no writer method for this key yet)
        types = [t == "full" for t in cfg["indexer_types"]]
        w.add_array(f"{w.arch}.attention.indexer.types", types)


def _softmax_moe(w: Writer, cfg: Config) -> None:
    _common(w, cfg)
    w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])


def _qwen3moe(w: Writer, cfg: Config) -> None:
    _softmax_moe(w, cfg)
    w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", True)))


def _llama(w: Writer, cfg: Config) -> None:
    _softmax_moe(w, cfg)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_rope_dimension_count(hd)


def _gpt_oss(w: Writer, cfg: Config) -> None:
    _common(w, cfg)
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_sliding_window(cfg["sliding_window"])


def _dsa_check(cfg: Config) -> str | None:
    if cfg.get("index_head_dim") != 128:
        return (
            f"llama.cpp's DSA indexer takes index_head_dim 128 (this model: "
            f"{cfg.get('index_head_dim')}; other sizes abort its graph)"
        )
    return None


def _qwen3moe_check(cfg: Config) -> str | None:
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        return "llama.cpp's qwen3moe has no dense layers (mlp_only_layers, decoder_sparse_step)"
    return None


def _olmoe_check(cfg: Config) -> str | None:
    kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if kv != cfg["num_attention_heads"]:
        return "llama.cpp's olmoe has no grouped-query attention (num_key_value_heads)"
    if cfg.get("clip_qkv"):
        return "llama.cpp's olmoe has no clip_qkv"
    return None


def _llama_check(cfg: Config) -> str | None:
    window = cfg.get("sliding_window")
    if window and window < cfg["max_position_embeddings"]:
        return f"llama.cpp's llama architecture has no sliding window (sliding_window={window})"
    return None


def _gpt_oss_check(cfg: Config) -> str | None:
    limit, alpha = cfg.get("swiglu_limit", 7.0), cfg.get("swiglu_alpha", 1.702)
    if (float(limit), float(alpha)) != (7.0, 1.702):
        return (
            f"llama.cpp's gpt-oss fixes swiglu_limit 7.0 and alpha 1.702 "
            f"(this model: {limit}, {alpha})"
        )
    return None


FAMILIES = {
    f.model_type: f
    for f in (
        Family("glm4_moe", "glm4moe", "GLM4_MOE", _glm4moe),
        Family("deepseek_v3", "deepseek2", "DEEPSEEK2", _mla),
        Family("glm_moe_dsa", "glm-dsa", "GLM_DSA", _dsa, _dsa_check),
        # llama.cpp names V3.2's tensors as GLM-5's (the gguf package has no map of its own)
        Family("deepseek_v32", "deepseek32", "GLM_DSA", _dsa, _dsa_check),
        Family("qwen3_moe", "qwen3moe", "QWEN3MOE", _qwen3moe, _qwen3moe_check),
        Family("olmoe", "olmoe", "OLMOE", _softmax_moe, _olmoe_check),
        Family("mixtral", "llama", "LLAMA", _llama, _llama_check),
        Family("gpt_oss", "gpt-oss", "GPT_OSS", _gpt_oss, _gpt_oss_check),
    )
}


def family_of(cfg: Config) -> Family:
    """The family of config.json, or a one-line refusal naming what is missing."""
    model_type = cfg.get("model_type")
    fam = FAMILIES.get(str(model_type))
    if fam is None:
        raise ConvertError(
            f"cannot export model_type {model_type!r} to GGUF "
            f"(exportable: {', '.join(sorted(FAMILIES))})"
        )
    problem = fam.check(cfg)
    if problem:
        raise ConvertError(f"cannot export this {model_type} to GGUF: {problem}")
    return fam


def layer_of(name: str) -> int | None:
    m = LAYER.match(name)
    return int(m.group(1)) if m else None


class Names:
    """Checkpoint names -> llama.cpp tensor names, for one family and block count."""

    def __init__(self, fam: Family, n_blocks: int) -> None:
        import gguf

        self._map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[fam.name_map], n_blocks)

    def __call__(self, name: str) -> str:
        if name.endswith(".sinks"):  # gpt-oss: a bare parameter, a ".weight" to llama.cpp
            base = self._map.get_name(name)
            out = base and base + ".weight"
        else:
            out = self._map.get_name(name, try_suffixes=(".weight", ".bias"))
        if out is None and name.endswith("_bias"):  # e_score_correction_bias
            base = self._map.get_name(name[: -len("_bias")])
            out = base and base + ".bias"
        if out is None:
            raise ConvertError(f"no llama.cpp tensor name for {name!r}")
        return out
