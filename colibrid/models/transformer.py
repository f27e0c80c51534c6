"""The decoder stack every supported family shares: embed, N decoder layers (attention then
dense MLP or MoE, each pre-normed with a residual), final norm, LM head.

A family module only says how its config maps to shapes and which attention a layer uses.

Shape legend: S rows, D hidden, V vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibrid.backends.base import KernelFamily
from colibrid.models.base import (
    DraftLayer,
    ExpertSource,
    Lookahead,
    NextMoE,
    Ops,
    Segment,
    WeightSource,
)
from colibrid.models.layers.biased_moe import BiasedMoE, ClampedGLU, ExpertBiases
from colibrid.models.layers.mlp import MLP
from colibrid.models.layers.moe import MoE
from colibrid.models.layers.rope import Rotary
from colibrid.models.layers.router import Router

# The stored names of an expert's gate, up and down projections in most checkpoints.
SWIGLU_NAMES = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class MoEArgs:
    """The MoE half of a config. The first eight fields are DeepSeek-V3's (shared by
    GLM-4.x and GLM-5.x); the rest have those families' values as defaults and say what
    the softmax-routed families (Qwen3-MoE, Mixtral, OLMoE) do differently: ``softmax``
    router scores, and where the router and experts are stored (``module``: the layer's
    submodule holding the router and ``experts``; ``expert_names``: the stored names of
    gate, up and down) and what gpt-oss adds: the router's submodule name (``router``),
    a bias on its logits (``router_bias``) and experts with biases and a clamped SwiGLU
    (``glu``; the biases stored as transformers names them, ``experts.gate_up_proj_bias``
    [E, 2F] with gate and up interleaved, ``experts.down_proj_bias`` [E, D])."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    softmax: bool = False
    module: str = "mlp"
    expert_names: tuple[str, str, str] = SWIGLU_NAMES
    router: str = "gate"
    router_bias: bool = False
    glu: ClampedGLU | None = None


class DecoderLayer:
    def __init__(
        self,
        attention: Any,
        mlp: MLP | MoE,
        input_norm: np.ndarray,
        post_norm: np.ndarray,
        eps: float,
        ops: Ops,
    ) -> None:
        self.ops = ops
        self.attention = attention
        self.mlp = mlp
        self.input_norm = input_norm
        self.post_norm = post_norm
        self.eps = eps
        self.lookahead: Lookahead | None = None  # PILOT's guess (Transformer.set_lookahead)

    def __call__(
        self,
        h: np.ndarray,
        layer: int,
        segments: Sequence[Segment],
        rope: tuple[np.ndarray, np.ndarray],
        selections: list[np.ndarray | None],
    ) -> np.ndarray:
        """The layer on every row of the pass; `selections` (a DSA key selection per
        segment, or None) are read and replaced in place."""
        t0 = time.perf_counter()
        attn = self.attend(
            self.ops.rms_norm(h, self.input_norm, self.eps), layer, segments, rope, selections
        )
        clock = segments[0].step.clock
        if clock is not None:
            clock.attention_s += time.perf_counter() - t0
        h, normed = self.ops.add_rms_norm(h, attn, self.post_norm, self.eps)
        if self.lookahead is not None:
            self.lookahead(h)
        return h + self.mlp(normed, segments[0].step.family)

    def attend(
        self,
        x: np.ndarray,
        layer: int,
        segments: Sequence[Segment],
        rope: tuple[np.ndarray, np.ndarray],
        selections: list[np.ndarray | None],
    ) -> np.ndarray:
        """Attention of each segment's rows over its own cache: [S, D]."""
        if len(segments) == 1:
            seg = segments[0]
            out, selections[0] = self.attention(x, layer, seg.cache, seg.step, rope, selections[0])
            return out
        out = np.empty_like(x)
        cos, sin = rope
        r0 = 0
        for k, seg in enumerate(segments):
            r1 = r0 + seg.rows
            out[r0:r1], selections[k] = self.attention(
                x[r0:r1], layer, seg.cache, seg.step, (cos[r0:r1], sin[r0:r1]), selections[k]
            )
            r0 = r1
        return out

    def mlp_input(self, h: np.ndarray) -> np.ndarray:
        """The post-attention residual as the MLP sees it (PILOT guesses from it too)."""
        return self.ops.rms_norm(h, self.post_norm, self.eps)

    # ---- models.base.NextMoE, for a layer whose MLP is a MoE -----------------------------
    @property
    def moe_layer(self) -> int:
        assert isinstance(self.mlp, MoE)
        return self.mlp.layer

    @property
    def top_k(self) -> int:
        assert isinstance(self.mlp, MoE)
        return self.mlp.router.top_k

    def candidates(self, h: np.ndarray, n: int) -> np.ndarray:
        """The experts this layer's router ranks best for the residual ``h`` before it."""
        assert isinstance(self.mlp, MoE)
        return self.mlp.router.candidates(self.mlp_input(h), n)


def load_decoder_layer(
    src: WeightSource,
    ops: Ops,
    experts: ExpertSource,
    layer: int,
    attention: Any,
    *,
    hidden: int,
    eps: float,
    moe: MoEArgs | None,
    dense_width: int,
) -> DecoderLayer:
    """A decoder layer; `moe` None means a dense MLP of `dense_width`."""
    prefix = f"model.layers.{layer}"
    if moe is None:
        mlp: MLP | MoE = MLP(src, ops, f"{prefix}.mlp", hidden, dense_width)
    else:
        mlp = load_moe(src, ops, experts, layer, hidden, moe)
    return DecoderLayer(
        attention,
        mlp,
        src.vector(f"{prefix}.input_layernorm.weight", (hidden,)),
        src.vector(f"{prefix}.post_attention_layernorm.weight", (hidden,)),
        eps,
        ops,
    )


def load_moe(
    src: WeightSource, ops: Ops, experts: ExpertSource, layer: int, hidden: int, args: MoEArgs
) -> MoE:
    prefix = f"model.layers.{layer}.{args.module}"
    gate = f"{prefix}.{args.router}"
    n = args.n_routed_experts
    # The selection bias belongs to the sigmoid router (DeepSeek/GLM); a softmax family
    # never reads one, even where a checkpoint carries a stray tensor of that name.
    bias_name = f"{gate}.e_score_correction_bias"
    has_bias = not args.softmax and src.has(bias_name)
    router = Router(
        src.vector(f"{gate}.weight", (n, hidden)),
        src.vector(bias_name, (n,)) if has_bias else None,
        top_k=args.num_experts_per_tok,
        n_group=args.n_group,
        topk_group=args.topk_group,
        norm_topk_prob=args.norm_topk_prob,
        scaling=args.routed_scaling_factor,
        softmax=args.softmax,
        logit_bias=src.vector(f"{gate}.bias", (n,)) if args.router_bias else None,
        ops=ops,
    )
    if args.glu is not None:
        return BiasedMoE(
            layer, router, experts, ops, expert_biases(src, prefix, hidden, args), args.glu
        )
    shared = None
    if args.n_shared_experts > 0:
        shared = MLP(
            src,
            ops,
            f"{prefix}.shared_experts",
            hidden,
            args.moe_intermediate_size * args.n_shared_experts,
        )
    return MoE(layer, router, experts, ops, shared)


def expert_biases(src: WeightSource, prefix: str, hidden: int, args: MoEArgs) -> ExpertBiases:
    """A layer's expert biases; gate and up de-interleaved from transformers' fused
    ``gate_up_proj_bias`` (gate at even, up at odd positions)."""
    n, width = args.n_routed_experts, args.moe_intermediate_size
    gate_up = np.asarray(src.vector(f"{prefix}.experts.gate_up_proj_bias", (n, 2 * width)))
    down = src.vector(f"{prefix}.experts.down_proj_bias", (n, hidden))
    return ExpertBiases(
        np.ascontiguousarray(gate_up[:, 0::2], dtype=np.float32),
        np.ascontiguousarray(gate_up[:, 1::2], dtype=np.float32),
        np.ascontiguousarray(down, dtype=np.float32),
    )


class Transformer:
    """Embedding, decoder layers, final norm and head; `forward` runs S new rows.
    Implements models.base.Model."""

    mtp: DraftLayer | None = None  # the MTP layer, where the family loads one

    def __init__(
        self,
        src: WeightSource,
        ops: Ops,
        *,
        vocab: int,
        hidden: int,
        eps: float,
        layers: list[DecoderLayer],
        rotary: Rotary,
        tie_embeddings: bool,
    ) -> None:
        self.ops = ops
        self.vocab = vocab
        self.hidden = hidden
        self.eps = eps
        self.layers = layers
        self.rotary = rotary
        self.embed_tokens = src.weight("model.embed_tokens.weight", (vocab, hidden))
        self.norm = src.vector("model.norm.weight", (hidden,))
        if tie_embeddings and not src.has("lm_head.weight"):
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = src.weight("lm_head.weight", (vocab, hidden))

    def cache_layouts(self) -> list[dict[str, tuple[int, ...]]]:
        return [layer.attention.cache_layout() for layer in self.layers]

    def set_lookahead(self, make: Callable[[NextMoE], Lookahead]) -> int:
        """Every layer followed by a MoE layer gets ``make(that layer)`` as its lookahead."""
        n = 0
        for here, nxt in zip(self.layers, self.layers[1:], strict=False):
            if isinstance(nxt.mlp, MoE):
                here.lookahead = make(nxt)
                n += 1
        return n

    def hidden_states(self, tokens: np.ndarray, segments: Sequence[Segment]) -> np.ndarray:
        """Final-normed hidden states [S, D] for the new tokens (each segment's rows in
        turn); writes their KV into each segment's cache."""
        if sum(seg.rows for seg in segments) != len(tokens):
            raise ValueError("the segments do not cover the pass's rows")
        h = self.ops.embed(self.embed_tokens, tokens)  # [S, D]
        positions = np.concatenate([seg.step.start + np.arange(seg.rows) for seg in segments])
        rope = self.rotary.tables(positions)
        selections: list[np.ndarray | None] = [None] * len(segments)
        hook = segments[0].step.between_layers
        for index, layer in enumerate(self.layers):
            if hook is not None:
                hook(index)
            h = layer(h, index, segments, rope, selections)
        return self.ops.rms_norm(h, self.norm, self.eps)

    def logits(self, hidden: np.ndarray, family: KernelFamily) -> np.ndarray:
        return self.ops.matmul(self.lm_head, np.ascontiguousarray(hidden), family)  # [S, V]


def planned_cache_layouts(args: Any, src: WeightSource) -> list[dict[str, tuple[int, ...]]]:
    """Every trunk layer's cache layout from the config and the checkpoint's names, before
    the model is built: what sizes the KV budget the expert store is planned around
    (equal to the built model's ``cache_layouts()``)."""
    return [args.cache_layout_at(src, layer) for layer in range(args.trunk.num_hidden_layers)]


def build_transformer(
    args: Any, src: WeightSource, experts: ExpertSource, ops: Ops, rotary_dim: int
) -> Transformer:
    """Every family's trunk: a decoder layer per config layer (MoE where `args.is_moe` says,
    else the dense MLP), RoPE over `rotary_dim` dimensions, embedding and head."""
    t = args.trunk
    layers = [
        load_decoder_layer(
            src,
            ops,
            experts,
            layer,
            args.attention_at(src, ops, layer),
            hidden=t.hidden_size,
            eps=t.rms_norm_eps,
            moe=args.moe if args.is_moe[layer] else None,
            dense_width=t.intermediate_size,
        )
        for layer in range(t.num_hidden_layers)
    ]
    return Transformer(
        src,
        ops,
        vocab=t.vocab_size,
        hidden=t.hidden_size,
        eps=t.rms_norm_eps,
        layers=layers,
        rotary=Rotary(rotary_dim, args.rope, max_positions=t.max_position_embeddings),
        tie_embeddings=t.tie_word_embeddings,
    )
