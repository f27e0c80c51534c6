"""Config reading shared by the families: the dense trunk, the MoE arguments (sigmoid-routed
DeepSeek style, softmax-routed Qwen3-MoE / Mixtral / OLMoE style) and the small checks
several families need."""

from __future__ import annotations

from dataclasses import dataclass

from colibrid.models.base import (
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    ConfigReader,
)
from colibrid.models.transformer import SWIGLU_NAMES, MoEArgs

# The activations transformers' ACT2FN maps to SiLU, the only one the expert kernels compute.
SILU_NAMES = ("silu", "swish")


@dataclass(frozen=True)
class TrunkArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_mtp_layers: int


def read_trunk(r: ConfigReader) -> TrunkArgs:
    mtp = r.config.get("num_nextn_predict_layers", r.config.get("num_mtp_layers", 0)) or 0
    return TrunkArgs(
        vocab_size=r.int("vocab_size", hi=MAX_VOCAB),
        hidden_size=r.int("hidden_size"),
        intermediate_size=r.int("intermediate_size"),
        num_hidden_layers=r.int("num_hidden_layers", hi=MAX_LAYERS),
        rms_norm_eps=r.float("rms_norm_eps", 1e-6, lo=0.0, hi=1.0),
        max_position_embeddings=r.int("max_position_embeddings", 4096, hi=MAX_POSITIONS),
        tie_word_embeddings=r.bool("tie_word_embeddings", False),
        num_mtp_layers=ConfigReader({"num_mtp_layers": mtp}, r.arch).int(
            "num_mtp_layers", lo=0, hi=8
        ),
    )


def read_moe(r: ConfigReader) -> MoEArgs:
    experts = r.int("n_routed_experts", r.config.get("num_local_experts"), hi=MAX_EXPERTS)
    args = MoEArgs(
        n_routed_experts=experts,
        num_experts_per_tok=r.int("num_experts_per_tok", hi=experts),
        moe_intermediate_size=r.int("moe_intermediate_size"),
        n_shared_experts=r.int("n_shared_experts", 0, lo=0, hi=64),
        n_group=r.int("n_group", 1, hi=experts),
        topk_group=r.int("topk_group", 1, hi=experts),
        norm_topk_prob=r.bool("norm_topk_prob", True),
        routed_scaling_factor=r.float("routed_scaling_factor", 1.0, hi=1e6),
    )
    if experts % args.n_group:
        raise r._fail("n_group", f"= {args.n_group} does not divide {experts} experts")
    if args.topk_group > args.n_group:
        raise r._fail("topk_group", f"= {args.topk_group} exceeds n_group = {args.n_group}")
    if args.n_group > 1 and experts // args.n_group < 2:
        raise r._fail("n_group", "leaves fewer than 2 experts per group")
    if args.n_group > 1 and args.num_experts_per_tok > args.topk_group * (experts // args.n_group):
        raise r._fail("num_experts_per_tok", "exceeds the experts of the selected groups")
    return args


def moe_layers(r: ConfigReader, n_layers: int, default_dense: int) -> list[bool]:
    """Which layers are MoE: `mlp_layer_types` if given, else after `first_k_dense_replace`."""
    kinds = r.str_list("mlp_layer_types", n_layers, {"dense", "sparse"})
    if kinds is not None:
        return [k == "sparse" for k in kinds]
    first_dense = r.int("first_k_dense_replace", default_dense, lo=0, hi=MAX_LAYERS)
    return [layer >= first_dense for layer in range(n_layers)]


def read_softmax_moe(
    r: ConfigReader,
    *,
    width_key: str,
    default_top_k: int,
    norm_topk_prob: bool | None,
    module: str = "mlp",
    expert_names: tuple[str, str, str] = SWIGLU_NAMES,
) -> MoEArgs:
    """Softmax routing without groups, shared experts or scaling (Qwen3-MoE, Mixtral,
    OLMoE). The expert count is `num_experts` or `num_local_experts` (transformers maps one
    to the other); `width_key` names the experts' FFN width. ``norm_topk_prob`` None reads
    the key (default False, as Qwen3-MoE's and OLMoE's configs); a bool fixes it (Mixtral
    always renormalises its top-k)."""
    key = "num_experts" if r.config.get("num_experts") is not None else "num_local_experts"
    experts = r.int(key, hi=MAX_EXPERTS)
    norm = r.bool("norm_topk_prob", False) if norm_topk_prob is None else norm_topk_prob
    return MoEArgs(
        n_routed_experts=experts,
        num_experts_per_tok=r.int("num_experts_per_tok", default_top_k, hi=experts),
        moe_intermediate_size=r.int(width_key),
        n_shared_experts=0,
        n_group=1,
        topk_group=1,
        norm_topk_prob=norm,
        routed_scaling_factor=1.0,
        softmax=True,
        module=module,
        expert_names=expert_names,
    )


def require_silu(r: ConfigReader) -> None:
    """Refuse a `hidden_act` other than SiLU: the expert and MLP kernels compute SwiGLU."""
    act = r.config.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise r._fail("hidden_act", f"= {act!r} is not supported (supported: silu)")


def read_window(r: ConfigReader, key: str = "sliding_window") -> int | None:
    """A sliding attention window in keys, or None (the key absent or null)."""
    return r.optional_int(key, hi=MAX_POSITIONS)
