"""Write a colibri ``glm4_moe`` container as a GGUF llama.cpp runs: the same weights.

Why: the side-by-side far beyond RAM (`colibri bench peer --far`) must give both runtimes
the same model at the same bits per weight, and a bf16 checkpoint of a GLM-4.5-Air-shaped
model big enough to stream (tens of GB) cannot be kept on a development disk next to both
conversions. So the synthetic container (`colibri synth --shape glm4-air`) is re-encoded
block for block, without requantising:

* int4 group-64 (nibble = q + 8, f32 scale per 64) -> two Q4_0 blocks per group (32
  weights, nibble = q + 8, one f16 scale each): the same codes; the scale rounded to f16.
  Both are 4.5 bits per weight.
* int8 rows (one f32 scale per row) -> Q8_0 (32 int8 codes and an f16 scale per block,
  the row's scale in every block): the same codes.
* f32 vectors and the router stay f32.

Names and metadata follow llama.cpp's ``glm4moe`` architecture (its converter's keys).
The tokenizer is left out (``tokenizer.ggml.model = none`` with the model's vocabulary
size): the benchmark feeds token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from colibrid.errors import ConvertError
from colibrid.formats.weights import QuantWeight, WeightFormat
from colibrid.store.checkpoint import Checkpoint

ARCH = "glm4moe"
Q4_0_BLOCK = 32
Made = tuple[np.ndarray, Any]  # (the bytes or values, the GGUF type or None for f32)


def _q4_0(w: QuantWeight) -> np.ndarray:
    """int4 [O, I] (groups of 64, or one scale per row) -> Q4_0 bytes [O, I / 32 * 18]."""
    o, i = w.shape
    groups = 1 if w.group_size in (0, i) else -(-i // w.group_size)
    if w.fmt != WeightFormat.Q4 or i % groups or (i // groups) % Q4_0_BLOCK:
        raise ConvertError(
            f"Q4_0 export needs int4 groups of a multiple of 32 weights, got {w.shape} "
            f"in groups of {w.group_size or i}"
        )
    packed = np.asarray(w.data).reshape(o, i // 2)
    codes = np.empty((o, i), dtype=np.uint8)
    codes[:, 0::2] = packed & 15
    codes[:, 1::2] = packed >> 4
    blocks = codes.reshape(o, i // Q4_0_BLOCK, Q4_0_BLOCK)
    qs = blocks[:, :, :16] | (blocks[:, :, 16:] << 4)
    per_group = i // groups // Q4_0_BLOCK
    scale = np.asarray(w.scales, dtype=np.float32).reshape(o, groups)
    scale = np.repeat(scale, per_group, axis=1)
    d = scale.astype(np.float16).view(np.uint8).reshape(o, i // Q4_0_BLOCK, 2)
    return np.concatenate([d, qs], axis=2).reshape(o, i // Q4_0_BLOCK * 18)


def _q8_0(w: QuantWeight) -> np.ndarray:
    """int8 rows [O, I] -> Q8_0 bytes [O, I / 32 * 34]."""
    o, i = w.shape
    if w.fmt != WeightFormat.Q8 or i % Q4_0_BLOCK:
        raise ConvertError(f"Q8_0 export needs int8 rows of a multiple of 32, got {w}")
    codes = np.asarray(w.data).view(np.uint8).reshape(o, i // Q4_0_BLOCK, Q4_0_BLOCK)
    scale = np.asarray(w.scales, dtype=np.float32).reshape(o, 1).astype(np.float16)
    d = np.repeat(scale.view(np.uint8).reshape(o, 1, 2), i // Q4_0_BLOCK, axis=1)
    return np.concatenate([d, codes], axis=2).reshape(o, i // Q4_0_BLOCK * 34)


def _matrix(w: QuantWeight) -> Made:
    import gguf

    if w.fmt == WeightFormat.Q4:
        return _q4_0(w), gguf.GGMLQuantizationType.Q4_0
    if w.fmt == WeightFormat.Q8:
        return _q8_0(w), gguf.GGMLQuantizationType.Q8_0
    return np.ascontiguousarray(w.data, dtype=np.float32), None


class _Tensor:
    """One GGUF tensor, produced only when it is written (a layer's experts are ~1 GB);
    ``probe`` gives an array of its shape and type cheaply, for the header."""

    def __init__(
        self, name: str, make: Callable[[], Made], probe: Callable[[], Made] | None = None
    ) -> None:
        self.name, self.make, self.probe = name, make, probe or make


def _tensors(ckpt: Checkpoint, cfg: dict[str, Any]) -> Iterator[_Tensor]:
    h, ffn, moe_ffn = cfg["hidden_size"], cfg["intermediate_size"], cfg["moe_intermediate_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    vocab, n_exp = cfg["vocab_size"], cfg["n_routed_experts"]
    shared = cfg.get("n_shared_experts") or 0

    def mat(name: str, shape: tuple[int, int]) -> Callable[[], Made]:
        return lambda: _matrix(ckpt.weight(name, shape))

    def vec(name: str, n: int) -> Callable[[], Made]:
        return lambda: (np.ascontiguousarray(ckpt.vector(name, (n,)), dtype=np.float32), None)

    def experts(layer: int, proj: str, shape: tuple[int, int]) -> tuple[Callable, Callable]:
        def one(e: int) -> Made:
            name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
            return _matrix(ckpt.weight(name, shape))

        def make() -> Made:
            parts = [one(e) for e in range(n_exp)]
            return np.stack([p for p, _ in parts]), parts[0][1]

        def probe() -> Made:
            data, raw = one(0)
            return np.broadcast_to(data, (n_exp, *data.shape)), raw

        return make, probe

    yield _Tensor("token_embd.weight", mat("model.embed_tokens.weight", (vocab, h)))
    yield _Tensor("output_norm.weight", vec("model.norm.weight", h))
    yield _Tensor("output.weight", mat("lm_head.weight", (vocab, h)))
    dense = cfg.get("first_k_dense_replace", 0)
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        yield _Tensor(b + "attn_norm.weight", vec(p + "input_layernorm.weight", h))
        for ours, theirs, rows in (
            ("q", "q", heads * hd),
            ("k", "k", kv * hd),
            ("v", "v", kv * hd),
        ):
            yield _Tensor(
                f"{b}attn_{theirs}.weight", mat(f"{p}self_attn.{ours}_proj.weight", (rows, h))
            )
            if cfg.get("attention_bias"):
                yield _Tensor(f"{b}attn_{theirs}.bias", vec(f"{p}self_attn.{ours}_proj.bias", rows))
        yield _Tensor(b + "attn_output.weight", mat(p + "self_attn.o_proj.weight", (h, heads * hd)))
        yield _Tensor(
            b + "post_attention_norm.weight", vec(p + "post_attention_layernorm.weight", h)
        )
        if i < dense:
            yield _Tensor(b + "ffn_gate.weight", mat(p + "mlp.gate_proj.weight", (ffn, h)))
            yield _Tensor(b + "ffn_up.weight", mat(p + "mlp.up_proj.weight", (ffn, h)))
            yield _Tensor(b + "ffn_down.weight", mat(p + "mlp.down_proj.weight", (h, ffn)))
            continue
        yield _Tensor(
            b + "ffn_gate_inp.weight",
            lambda p=p: (
                np.ascontiguousarray(ckpt.vector(p + "mlp.gate.weight", (n_exp, h)), np.float32),
                None,
            ),
        )
        yield _Tensor(b + "exp_probs_b.bias", vec(p + "mlp.gate.e_score_correction_bias", n_exp))
        yield _Tensor(b + "ffn_gate_exps.weight", *experts(i, "gate_proj", (moe_ffn, h)))
        yield _Tensor(b + "ffn_up_exps.weight", *experts(i, "up_proj", (moe_ffn, h)))
        yield _Tensor(b + "ffn_down_exps.weight", *experts(i, "down_proj", (h, moe_ffn)))
        if shared:
            sf = moe_ffn * shared
            s = p + "mlp.shared_experts."
            yield _Tensor(b + "ffn_gate_shexp.weight", mat(s + "gate_proj.weight", (sf, h)))
            yield _Tensor(b + "ffn_up_shexp.weight", mat(s + "up_proj.weight", (sf, h)))
            yield _Tensor(b + "ffn_down_shexp.weight", mat(s + "down_proj.weight", (h, sf)))


def _metadata(w: Any, cfg: dict[str, Any]) -> None:
    import gguf

    rope = cfg.get("rope_parameters") or {}
    hd = cfg["head_dim"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(int(hd * rope.get("partial_rotary_factor", 0.5)))
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg.get("n_shared_experts") or 0)
    w.add_leading_dense_block_count(cfg.get("first_k_dense_replace", 0))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(float(cfg.get("routed_scaling_factor", 1.0)))
    w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", True)))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("none")


def export(container: Path, out: Path, progress: Callable[[int, int], None] | None = None) -> Path:
    """Write ``out`` (atomically: a temporary name renamed at the end); returns it."""
    import gguf

    ckpt = Checkpoint.open(container)
    try:
        cfg = dict(ckpt.config)
        if cfg.get("model_type") != "glm4_moe":
            raise ConvertError(
                f"{container}: GGUF export covers glm4_moe (GLM-4.5-Air-shaped), "
                f"not {cfg.get('model_type')!r}"
            )
        tensors = list(_tensors(ckpt, cfg))
        tmp = out.with_name(out.name + ".part")
        writer = gguf.GGUFWriter(None, ARCH)
        _metadata(writer, cfg)
        for t in tensors:  # shapes first: the header precedes the data
            data, raw = t.probe()
            writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, raw)
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for k, t in enumerate(tensors):
            writer.write_tensor_data(t.make()[0])
            if progress is not None:
                progress(k + 1, len(tensors))
        writer.close()
        tmp.replace(out)
        return out
    finally:
        ckpt.close()
