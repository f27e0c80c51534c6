"""``colibri synth``: a synthetic container with real per-layer shapes, for benchmarks.

Why: real GLM-5 weights (~400 GB as int4) do not fit a development machine, but the
streaming engine's behaviour depends only on the I/O regime: ~21 MB int4-g64 experts,
8 of them per MoE layer per token, read from a file far larger than the page cache.
A container with GLM-5's exact per-layer shapes (hidden 6144, MLA dims, expert FFN
2048, top-8, one shared expert) but fewer layers and experts reproduces that regime.

The weights are invented directly in container form, group by group (random nibbles /
int8 codes with plausible scales, std ~ 1/sqrt(fan-in)), never as f32 matrices, and go
through the same plan and shard writer as ``colibri convert`` (so the file layout,
expert adjacency, atomic shards and resumability are the converter's). Every tensor is
seeded from ``--seed`` and its name: the same arguments give the same bytes.

Sizing (``--shape glm5 --layers 4 --experts 32``): 1 dense + 3 MoE layers (the real
model's first layers are dense); 3 x 32 experts x 21.23 MB = 2.04 GB of experts, plus
~0.6 GB of attention, dense MLP, shared experts and an 8192-token int8 embedding and
head (the real 154,880-token vocabulary would add 1.9 GB that no benchmark streams),
~2.7 GB in all. The tokenizer is a byte-level BPE (256 byte tokens + GLM-style special
tokens, no merges); config.vocab_size is larger, as in real checkpoints.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from colibrid.convert.convert import SIDE_FILES, finish, prepare_dst, run_shards
from colibrid.convert.plan import (
    ConvertParams,
    Group,
    Shard,
    build_groups,
    expert_of,
    pack_shards,
)
from colibrid.convert.writer import write_atomic
from colibrid.engine.validate import expected_from_config
from colibrid.errors import ColibriError, ConvertError
from colibrid.formats import quant

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
)
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROWS_PER_BLOCK_BYTES = 8 << 20

SHAPES: dict[str, dict[str, Any]] = {
    "glm5": dict(
        model_type="glm_moe_dsa",
        architectures=["GlmMoeDsaForCausalLM"],
        hidden_size=6144,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        num_attention_heads=64,
        num_key_value_heads=64,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        num_experts_per_tok=8,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        index_topk=2048,
        index_head_dim=128,
        index_n_heads=32,
        rms_norm_eps=1e-5,
        max_position_embeddings=16384,
        rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        attention_bias=False,
        vocab_size=8192,
    ),
    "glm4-air": dict(
        model_type="glm4_moe",
        architectures=["Glm4MoeForCausalLM"],
        hidden_size=4096,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        num_experts_per_tok=8,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=16384,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "partial_rotary_factor": 0.5,
        },
        attention_bias=True,
        use_qk_norm=False,
        vocab_size=8192,
    ),
    "tiny": dict(  # GLM-5's structure at toy sizes: for tests
        model_type="glm_moe_dsa",
        architectures=["GlmMoeDsaForCausalLM"],
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=1024,
        rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        vocab_size=320,
    ),
}
# Qwen3-235B-A22B's per-layer shapes: GQA 64/4 heads of 128 with qk-norm, 128 experts of
# FFN 1536 (~10.6 MB each at int4-g64), top-8, softmax routing, no shared expert, every
# layer MoE (the real model has 94)
SHAPES["qwen3-235b"] = dict(
    model_type="qwen3_moe",
    architectures=["Qwen3MoeForCausalLM"],
    hidden_size=4096,
    intermediate_size=12288,
    moe_intermediate_size=1536,
    num_attention_heads=64,
    num_key_value_heads=4,
    head_dim=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rms_norm_eps=1e-6,
    max_position_embeddings=16384,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    attention_bias=False,
    vocab_size=8192,
)
# DeepSeek-V3.2's per-layer shapes: MLA with 128 heads (q-LoRA 1536, latent 512, nope 128 +
# rope 64, v 128), the DSA indexer (64 heads of 128, top-2048, rotate_half RoPE), 256 experts
# of FFN 2048 (~24.8 MB each at int4-g64), top-8 of 8 groups with 4 competing, one shared
# expert, YaRN x40 over 4096 positions; the real model has 61 layers (3 dense) and a
# 129,280-token vocabulary
SHAPES["deepseek-v32"] = dict(
    model_type="deepseek_v32",
    architectures=["DeepseekV32ForCausalLM"],
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    index_topk=2048,
    index_head_dim=128,
    index_n_heads=64,
    rms_norm_eps=1e-6,
    max_position_embeddings=16384,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    attention_bias=False,
    vocab_size=8192,
)
# The model types whose checkpoints carry an MTP layer (`--mtp`)
MTP_TYPES = ("glm_moe_dsa", "deepseek_v32")
# gpt-oss-120b's per-layer shapes (its config.json, GptOssConfig's defaults): GQA 64/8
# heads of 64 with biases and sinks, sliding (128 keys) and full layers alternating, YaRN,
# 128 experts of FFN 2880 (~13.2 MB each in MXFP4, kept as FP4 as `colibri convert` keeps
# the real checkpoint's) with biases, top-4, every layer MoE (the real model has 36;
# gpt-oss-20b has the same layer with 32 experts, 24 layers)
SHAPES["gpt-oss-120b"] = dict(
    model_type="gpt_oss",
    architectures=["GptOssForCausalLM"],
    hidden_size=2880,
    intermediate_size=2880,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_experts_per_tok=4,
    sliding_window=128,
    attention_bias=True,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    vocab_size=8192,
)
# Shapes whose routed experts ship as MXFP4 (kept as FP4 by the converter, so here too).
FP4_SHAPES = ("gpt-oss-120b",)
# The softmax-routed families: the key counting their experts; every layer MoE, no MTP.
EXPERTS_KEY = {"qwen3_moe": "num_experts", "gpt_oss": "num_local_experts"}
# GLM-4.5-Air's structure at toy sizes: for tests
SHAPES["glm4-tiny"] = dict(
    SHAPES["glm4-air"],
    hidden_size=128,
    intermediate_size=192,
    moe_intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts_per_tok=2,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    vocab_size=320,
)


def synth_config(shape: str, layers: int, experts: int, mtp: bool = False) -> dict[str, Any]:
    if shape not in SHAPES:
        raise ConvertError(f"--shape {shape!r}: choose from {', '.join(SHAPES)}")
    if layers < 1 or experts < 1:
        raise ConvertError("--layers and --experts must be >= 1")
    if mtp and SHAPES[shape]["model_type"] not in MTP_TYPES:
        raise ConvertError(
            f"--mtp: only GLM-5- and DeepSeek-V3.2-shaped models carry an MTP layer, not {shape!r}"
        )
    cfg = dict(SHAPES[shape])
    if cfg["model_type"] in EXPERTS_KEY:
        cfg[EXPERTS_KEY[cfg["model_type"]]] = experts
    else:
        cfg.update(
            n_routed_experts=experts,
            first_k_dense_replace=min(1, layers - 1),
            num_nextn_predict_layers=1 if mtp else 0,
        )
        if experts % cfg["n_group"] or experts // cfg["n_group"] < 2:
            # too few experts for the real groups (2 each at least): route without groups
            cfg.update(n_group=1, topk_group=1)
    cfg.update(
        num_hidden_layers=layers,
        num_experts_per_tok=min(cfg["num_experts_per_tok"], experts),
        tie_word_embeddings=False,
        bos_token_id=None,
        pad_token_id=None,
        eos_token_id=256,
        torch_dtype="bfloat16",
    )
    return cfg


def tokenizer_json() -> str:
    """A byte-level BPE with no merges: 256 byte tokens then the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok.to_str()


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def invent(group: Group, seed: int, heat_skew: float = 0.0) -> Iterator[tuple[str, np.ndarray]]:
    """The bytes of one group in file order: data of each item, then their scales."""
    scales: list[tuple[str, np.ndarray]] = []
    for item in group.items:
        rng = _rng(seed, item.name)
        if heat_skew and item.name.endswith(ROUTER_BIAS):
            yield item.name, _skewed_bias(item.shape, heat_skew, rng)
            continue
        bits = item.fmt.bits
        if item.fmt.fp4:  # uniform e2m1 codes (zero-mean), e8m0 scales near the target std
            out_f, in_f = item.shape
            yield item.name, np.frombuffer(rng.bytes(out_f * ((in_f + 1) // 2)), np.uint8)
            # uniform codes have std ~2.93 (e2m1 magnitudes 0..6); std 1/sqrt(fan-in)
            exponent = np.round(np.log2(in_f**-0.5 / 2.93)) + 127
            groups = -(-in_f // quant.FP4_GROUP)
            e = exponent + rng.integers(-1, 2, size=(out_f, groups))
            scales.append((item.name + ".qs", e.astype(np.uint8)))
            continue
        if not item.fmt.quantised:
            values = _float_tensor(item.name, item.shape, rng)
            yield item.name, values if bits == 32 else quant.f32_to_bf16(values)
            continue
        out_f, in_f = item.shape
        data = item.fmt.data_entry(item.name, item.shape)
        row = data.nbytes // out_f
        step = max(1, ROWS_PER_BLOCK_BYTES // max(1, row))
        for r0 in range(0, out_f, step):
            n = min(step, out_f - r0) * row
            yield item.name, _zero_mean_codes(rng.bytes(n), bits)
        entry = item.fmt.scale_entry(item.name, item.shape)
        assert entry is not None
        # uniform codes have std ~4.6 (int4) / ~74 (int8); aim at std 1/sqrt(fan-in),
        # embeddings at std ~1
        code_std = 4.6 if bits == 4 else 74.0
        target = 1.0 if item.name.endswith("embed_tokens.weight") else in_f**-0.5
        base = np.float32(target / code_std)
        jitter = rng.uniform(0.8, 1.2, size=entry.shape).astype(np.float32)
        scales.append((entry.name, (jitter * base).astype(np.float32)))
    yield from scales


ROUTER_BIAS = "e_score_correction_bias"


def _skewed_bias(shape: tuple[int, ...], heat_skew: float, rng: np.random.Generator) -> np.ndarray:
    """A router's selection bias drawn at standard deviation ``heat_skew``.

    Random router weights spread a layer's selections almost evenly over its experts; a
    trained router on one domain's text does not (reports range from no exploitable skew to a
    tenth of the experts taking most hits, docs/performance.md). The correction bias is added
    to the scores only to choose the top-k (the mixing weights stay the sigmoid scores), so a
    spread of biases makes some experts hot and others cold without changing what a chosen
    expert computes: a benchmark's heat can be set, and the figure says at which skew.
    """
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(heat_skew)).astype(np.float32)


def _zero_mean_codes(raw: bytes, bits: int) -> np.ndarray:
    """Uniform codes without the lone extreme (-8 / -128), so every weight matrix is
    zero-mean: uniform [-8, 7] has mean -0.5, a rank-one common mode that would swamp
    the input and make every token route (and predict) the same."""
    b = np.frombuffer(raw, dtype=np.uint8).copy()
    if bits == 8:
        b[b == 0x80] = 0
        return b
    lo, hi = b & 0x0F, b >> 4
    lo[lo == 0] = 8
    hi[hi == 0] = 8
    return lo | (hi << 4)


def _float_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if "norm" in name:
        return np.ones(shape, dtype=np.float32)
    if name.endswith((".bias", "_bias")):  # gpt-oss's fused expert biases too
        return np.zeros(shape, dtype=np.float32)
    fan_in = shape[-1] if shape else 1
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(fan_in**-0.5)


def synth_groups(shape: str, cfg: dict[str, Any], params: ConvertParams) -> list[Group]:
    """The container plan of a synthetic config: the tensors it needs, grouped as the
    converter groups them, the routed experts in FP4 for the shapes that ship MXFP4."""
    try:
        args, expected = expected_from_config(cfg, lambda name: True)
    except ColibriError as exc:
        raise ConvertError(f"synth config: {exc}") from None
    tensors = [(e.name, e.shape) for e in expected.values()]
    fp4 = frozenset(
        name for name, _ in tensors if shape in FP4_SHAPES and expert_of(name) is not None
    )
    return build_groups(tensors, args.trunk.num_hidden_layers, params, None, fp4)


def synth(
    dst: str | Path,
    shape: str = "glm5",
    layers: int = 4,
    experts: int = 32,
    *,
    seed: int = 0,
    params: ConvertParams | None = None,
    quiet: bool = True,
    mtp: bool = False,
    heat_skew: float = 0.0,
) -> Path:
    params = params or ConvertParams()
    params.check()
    cfg = synth_config(shape, layers, experts, mtp)
    groups = synth_groups(shape, cfg, params)
    shards = pack_shards(groups, params)
    if heat_skew < 0:
        raise ConvertError(f"--heat-skew {heat_skew}: a standard deviation, 0 or more")
    if heat_skew and not any(i.name.endswith(ROUTER_BIAS) for g in groups for i in g.items):
        raise ConvertError(f"--heat-skew: the {shape} shape's routers have no selection bias")
    identity = [
        ["synth", shape, layers, experts, seed]
        + (["mtp"] if mtp else [])
        + ([f"heat-skew={heat_skew}"] if heat_skew else [])
    ]
    dst = Path(dst)
    state = prepare_dst(dst, params, identity)
    if state.get("complete"):
        return dst

    def chunks_of(shard: Shard) -> Iterator[tuple[str, np.ndarray]]:
        for g in shard.groups:
            yield from invent(g, seed, heat_skew)

    run_shards(dst, shards, state, chunks_of, quiet=quiet)
    write_atomic(dst / "config.json", (json.dumps(cfg, indent=2) + "\n").encode())
    write_atomic(dst / "tokenizer.json", tokenizer_json().encode())
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": cfg["max_position_embeddings"],
    }
    write_atomic(dst / "tokenizer_config.json", (json.dumps(tok_cfg, indent=2) + "\n").encode())
    gen = {"eos_token_id": cfg["eos_token_id"], "do_sample": False}
    write_atomic(dst / "generation_config.json", (json.dumps(gen, indent=2) + "\n").encode())
    assert "tokenizer.json" in SIDE_FILES
    finish(
        dst,
        shards,
        state,
        {
            "synthetic": {
                "shape": shape,
                "layers": layers,
                "experts": experts,
                "seed": seed,
                "mtp": mtp,
                "heat_skew": heat_skew,
            }
        },
    )
    return dst


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri synth",
        description="Write a synthetic container with real per-layer shapes (random "
        "weights, same arguments -> same bytes).",
    )
    p.add_argument("dst", metavar="DST")
    p.add_argument("--shape", default="glm5", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bits", type=int, default=4, choices=(4, 8), help="routed experts")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--shard-gb", type=float, default=4.0)
    p.add_argument(
        "--mtp",
        action="store_true",
        help="add a (random) MTP layer after the last one, as GLM-5 checkpoints carry: "
        "speculative drafting runs on it (its guesses are random, so almost never kept)",
    )
    p.add_argument(
        "--heat-skew",
        type=float,
        default=0.0,
        metavar="S",
        help="spread the routers' selection biases at standard deviation S (0: random "
        "routers, almost even heat), so some experts run hot and others cold, as a trained "
        "router on one domain's text does; shapes whose router has no selection bias refuse it",
    )
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: Sequence[str]) -> int:
    a = build_parser().parse_args(list(argv))
    params = ConvertParams(
        expert_bits=a.bits, group_size=a.group_size, shard_bytes=int(a.shard_gb * 1e9)
    )
    started = time.perf_counter()
    try:
        out = synth(
            a.dst,
            a.shape,
            a.layers,
            a.experts,
            seed=a.seed,
            params=params,
            quiet=a.quiet,
            mtp=a.mtp,
            heat_skew=a.heat_skew,
        )
    except ColibriError as exc:
        print(f"colibri synth: error: {exc}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"{out}: {size / 1e9:.3f} GB in {time.perf_counter() - started:.1f} s")
    return 0
