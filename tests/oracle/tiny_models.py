"""Tiny random checkpoints of the supported MoE architectures + transformers reference outputs.

The numerical oracle of colibri: each checkpoint is built by transformers (the pinned version is
the reference), saved in the real Hugging Face layout, and a float32 reference is computed from
exactly the values stored in the folder:

* ``greedy_ids``: ``model.generate(prompt_ids, max_new_tokens=20, do_sample=False)`` (new tokens);
* ``tf_pred``: the argmax of one forward over the fixed 32-token sequence ``tf_ids`` (with
  ``tf_len=None``: over the prompt followed by the greedy continuation, as the config sweep uses).

The DSA references (GLM-5, DeepSeek-V3.2) keep transformers' arithmetic but pin its top-k
tie rule to the engine's (earlier position wins; ``pin_dsa_ties``), because torch leaves it
unspecified.

Plain module (no pytest imports) so engine tests and scripts can import it. Usage::

    ref = build_checkpoint("glm_moe_dsa", tmp_dir, dtype="f32")
    ref.greedy_ids, ref.tf_pred            # what the engine must reproduce token for token

Files written into ``out_dir``:

* ``config.json``, ``generation_config.json`` (from ``save_pretrained``);
* the weights: ``model.safetensors`` when there is no MTP shard, otherwise
  ``model-00001-of-00002.safetensors`` (the main model, as ``save_pretrained`` names the tensors)
  + ``mtp.safetensors`` (the MTP layer ``model.layers.{num_hidden_layers}.*``) +
  ``model.safetensors.index.json`` covering both;
* ``oracle.json`` (the reference), ``tf_logits.npy`` [32, vocab] and ``greedy_logits.npy``
  [20, vocab] (float32 logits, for tolerance-based debugging).

``dtype``:

* ``"f32"``: every tensor F32;
* ``"bf16"``: every tensor BF16 except ``e_score_correction_bias`` (F32, like the real
  checkpoints); the reference uses the bf16-rounded values computed in float32;
* ``"fp8"``: the 2-D linear weights except embeddings / lm_head / router / indexer
  ``weights_proj`` / MTP ``eh_proj`` / ``shared_head.head`` are F8_E4M3 with a F32
  ``<name>_scale_inv`` of shape [ceil(O/128), ceil(I/128)] next to them (``X.weight`` ->
  ``X.weight_scale_inv``; dequant = fp8 * scale_inv per 128x128 block) and config.json carries
  the DeepSeek ``quantization_config``; everything else F32. The reference uses the dequantised
  values.

``expert_transform(name, w) -> w'`` is applied to every routed expert matrix (per-expert 2-D
name, float32 numpy) before the reference is computed; the folder then stores ``w'`` as F32
(so transformers reloads exactly what the reference used) unless ``expert_container`` is given:
``expert_container(name, w) -> {tensor_name: ndarray}`` replaces each routed expert tensor in
the stored files by the returned tensors. The container receives the ORIGINAL weight (after
dtype rounding, before ``expert_transform``); pass ``expert_transform = dequant(quant(w))`` and
``expert_container = container_tensors(name, quant(w))`` to build a quantised oracle.
With ``expert_transform``/``expert_container`` routed experts are never bf16/fp8-encoded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode

from colibrid.convert import gpt_oss as gpt_oss_convert

# DeepSeek-style MoE (sigmoid router, groups, shared experts, an MTP layer) and softmax-routed
# MoE without shared experts or MTP.
SIGMOID_ARCHS = ("glm_moe_dsa", "deepseek_v32", "glm4_moe", "deepseek_v3")
# The DSA families: the same lightning indexer, RoPE interleaved (GLM-5) or rotate_half (V3.2).
DSA_ARCHS = ("glm_moe_dsa", "deepseek_v32")
SOFTMAX_ARCHS = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")
ARCHS = SIGMOID_ARCHS + SOFTMAX_ARCHS
MTP_ARCHS = SIGMOID_ARCHS
DTYPES = ("f32", "bf16", "fp8")

PROMPT_LEN = 12
GEN_LEN = 20
TF_LEN = 32
FP8_BLOCK = 128
FP8_MAX = 448.0
MAIN_SHARD = "model-00001-of-00002.safetensors"
MTP_SHARD = "mtp.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Per-arch default seeds, picked by scanning seeds 1..24 for the largest worst-case margins over
# the three dtypes (top1-top2 logit gaps, router k-th vs (k+1)-th, group selection, DSA top-k):
# some seeds give EXACT ties in the DSA index scores (e.g. glm_moe_dsa seeds 6, 7, 8), where the
# selection is implementation-defined.
DEFAULT_SEEDS = {
    "glm_moe_dsa": 9,
    "deepseek_v32": 9,
    "glm4_moe": 3,
    "deepseek_v3": 12,
    "qwen3_moe": 4,
    "mixtral": 2,
    "olmoe": 5,
    "gpt_oss": 3,
}

# Exact ties in the DSA index scores are common on tiny models: a key every index head scores
# below zero gets exactly 0 after the ReLU, so with few index heads several keys tie at 0. Which
# tied key `torch.topk` keeps is unspecified, and on CPU it depends on the row length, so
# transformers' cached decode (rows of t keys) and its uncached forward (rows of T keys, the
# future masked) pick differently (colibrid/models/NUMERICS.md has a reproduction). The
# reference therefore pins the tie rule the engine follows: among equal index scores the earlier
# position wins. Without exact ties this changes nothing (the diagnostics count the tied rows:
# "dsa_tied_rows").

ExpertTransform = Callable[[str, np.ndarray], np.ndarray]
ExpertContainer = Callable[[str, np.ndarray], dict]

_CLASSES = {
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}

# Shared by every architecture. eos_token_id is None so generation always yields 20 tokens.
_TRUNK = dict(
    vocab_size=384,
    hidden_size=128,
    intermediate_size=192,  # dense MLP (layer 0); 192 = 1.5 fp8 blocks -> partial block
    num_hidden_layers=3,  # layer 0 dense, layers 1..2 MoE
    num_attention_heads=4,
    hidden_act="silu",
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=None,
    pad_token_id=None,
)

# Shared by the sigmoid-routed architectures.
_COMMON = dict(
    _TRUNK,
    moe_intermediate_size=64,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    num_nextn_predict_layers=1,
)

# The MLA families' tiny attention and grouped routing (DeepSeek-V3, V3.2, GLM-5 alike).
_MLA = dict(
    num_key_value_heads=4,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    attention_bias=False,
)
# ... plus the DSA indexer (GLM-5 and DeepSeek-V3.2).
_DSA = dict(
    _MLA,
    index_topk=8,  # < 12-token prompt, < 32-token TF sequence: the indexer really selects
    index_head_dim=32,
    index_n_heads=8,
)

_ARCH_CONFIG = {
    "glm_moe_dsa": dict(
        _DSA,
        rms_norm_eps=1e-5,
        # layer 2 reuses layer 1's top-k ("shared"); GLM-5 configs without index_topk_freq /
        # index_topk_pattern give all-"full".
        indexer_types=["full", "full", "shared"],
    ),
    # every layer runs its indexer (V3.2 has no "shared" layers)
    "deepseek_v32": dict(_DSA, rms_norm_eps=1e-6),
    "glm4_moe": dict(
        num_key_value_heads=2,  # GQA 4:2
        head_dim=48,  # explicit, != hidden/heads (like GLM-4.5: 5120/96 with head_dim 128)
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.5,
        rms_norm_eps=1e-5,
        # partial_rotary_factor MUST be explicit (leaving it out also means 0.5 in transformers)
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        attention_bias=True,
        use_qk_norm=True,
    ),
    "deepseek_v3": dict(_MLA, rms_norm_eps=1e-6, rope_interleave=True),
}


# The softmax-routed architectures: 8 experts, top-2, no shared expert, no MTP layer.
_SOFTMAX_CONFIG = {
    "qwen3_moe": dict(
        _TRUNK,
        num_hidden_layers=4,
        mlp_only_layers=[2],  # layers 0, 1, 3 MoE; layer 2 a dense MLP of intermediate_size
        decoder_sparse_step=1,
        num_key_value_heads=2,
        head_dim=48,  # explicit, != hidden/heads (Qwen3-30B-A3B: 2048/32 with head_dim 128)
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        attention_bias=False,
    ),
    "mixtral": dict(
        _TRUNK,
        intermediate_size=192,  # the experts' width (no dense MLP): 1.5 fp8 blocks
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        sliding_window=8,  # < 12-token prompt, < 32-token TF sequence: the window really cuts
    ),
    "olmoe": dict(
        _TRUNK,
        intermediate_size=160,  # the experts' width (no dense MLP): ragged int4-g64 groups
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        clip_qkv=None,
    ),
    # 3 layers: sliding, full, sliding (GptOssConfig's default layer_types); the window of 8
    # cuts the 12-token prompt; swiglu_limit 1.5 (7.0 in the real models) so that the clamps
    # bite on tiny random activations; YaRN as the real models, scaled down.
    "gpt_oss": dict(
        _TRUNK,
        intermediate_size=96,  # the experts' width: 3 MXFP4 blocks of 32
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        sliding_window=8,
        attention_bias=True,
        swiglu_alpha=1.702,
        swiglu_limit=1.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    ),
}


def tiny_config(arch: str, **overrides) -> transformers.PretrainedConfig:
    """The tiny config of ``arch``; keyword overrides replace single fields."""
    if arch not in _CLASSES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if arch in SOFTMAX_ARCHS:
        kwargs = {**_SOFTMAX_CONFIG[arch], **overrides}
    else:
        kwargs = {**_COMMON, **_ARCH_CONFIG[arch], **overrides}
    if arch == "glm_moe_dsa" and kwargs.get("indexer_types") is not None:
        n = kwargs["num_hidden_layers"]
        kwargs["indexer_types"] = list(kwargs["indexer_types"])[:n] + ["full"] * max(
            0, n - len(kwargs["indexer_types"])
        )
    config = getattr(transformers, _CLASSES[arch][0])(**kwargs)
    config._attn_implementation = "eager"
    return config


@dataclasses.dataclass
class OracleReference:
    arch: str
    dtype: str
    out_dir: Path
    prompt_ids: list[int]
    greedy_ids: list[int]
    tf_ids: list[int]
    tf_pred: list[int]
    tf_logits_top2_gap: float
    greedy_logits_top2_gap: float
    transformers_version: str
    seed: int
    with_mtp: bool
    num_hidden_layers: int
    diagnostics: dict

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["out_dir"] = str(self.out_dir)
        return d

    @classmethod
    def load(cls, out_dir: Path) -> OracleReference:
        d = json.loads((Path(out_dir) / "oracle.json").read_text())
        d["out_dir"] = Path(out_dir)
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})

    @property
    def tf_logits(self) -> np.ndarray:
        return np.load(self.out_dir / "tf_logits.npy")

    @property
    def greedy_logits(self) -> np.ndarray:
        return np.load(self.out_dir / "greedy_logits.npy")


# ----------------------------------------------------------------------------- initialisation


def _init_tensor(
    name: str, shape: tuple, gen: torch.Generator, transposed: bool = False
) -> torch.Tensor:
    """Deterministic random init by tensor name (works for fused and per-expert names);
    ``transposed``: fused experts are stored [E, I, O] (gpt-oss), not [E, O, I]."""

    def randn(std):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    if name.endswith("e_score_correction_bias"):
        n = shape[0]
        perm = torch.randperm(n, generator=gen)
        return torch.linspace(-0.1, 0.1, n, dtype=torch.float32)[perm]
    if name.endswith("norm.weight"):  # RMSNorms, indexer LayerNorm, qk-norm, shared_head.norm
        return 1.0 + randn(0.1)
    if name.endswith((".bias", "_proj_bias")):  # gpt-oss's fused expert biases too
        return randn(0.2)
    if name.endswith("self_attn.sinks"):  # gpt-oss: a logit per head, comparable to scores
        return randn(1.0)
    if name.endswith("embed_tokens.weight"):
        return randn(1.0)
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # fused [E, O, I]
        return randn(1.0 / math.sqrt(shape[-2] if transposed else shape[-1]))
    if len(shape) == 2:  # [out, in] linear
        return randn(1.0 / math.sqrt(shape[1]))
    raise ValueError(f"no init rule for {name} {shape}")


def _init_model(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        transposed = model.config.model_type == "gpt_oss"
        for name, p in model.named_parameters():
            p.copy_(_init_tensor(name, tuple(p.shape), gen, transposed))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(_init_tensor(name, tuple(b.shape), gen))


def _mtp_tensors(main: dict, config, gen: torch.Generator) -> dict:
    """Random MTP layer ``model.layers.{N}.*`` (DeepSeek-V3 / GLM checkpoint naming).

    A full MoE decoder layer (attention incl. the DSA indexer of DSA_ARCHS, router, per-expert
    routed experts, shared expert, input/post-attention norms) + enorm, hnorm, eh_proj [H, 2H],
    shared_head.norm, and copies of the embedding / lm_head (``embed_tokens``,
    ``shared_head.head``) as the real checkpoints carry them.
    """
    n = config.num_hidden_layers
    moe_layer = next(i for i in range(n) if f"model.layers.{i}.mlp.gate.weight" in main)
    src, dst = f"model.layers.{moe_layer}.", f"model.layers.{n}."
    out = {}
    for k in sorted(main):
        if k.startswith(src):
            name = dst + k[len(src) :]
            out[name] = _init_tensor(name, tuple(main[k].shape), gen)
    h = config.hidden_size
    out[dst + "enorm.weight"] = _init_tensor("enorm.weight", (h,), gen)
    out[dst + "hnorm.weight"] = _init_tensor("hnorm.weight", (h,), gen)
    out[dst + "eh_proj.weight"] = _init_tensor("eh_proj.weight", (h, 2 * h), gen)
    out[dst + "shared_head.norm.weight"] = _init_tensor("shared_head.norm.weight", (h,), gen)
    out[dst + "shared_head.head.weight"] = main["lm_head.weight"].clone()
    out[dst + "embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
    return out


# ----------------------------------------------------------------------------- storage encodings


_ROUTED_EXPERT = re.compile(
    r"\.(mlp\.experts\.\d+\.(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$"
)


def is_routed_expert(name: str) -> bool:
    """A routed expert matrix: ``mlp.experts.E.{gate,up,down}_proj`` or Mixtral's
    ``block_sparse_moe.experts.E.w{1,2,3}``."""
    return _ROUTED_EXPERT.search(name) is not None


def router_name(arch: str, layer: int) -> str:
    """The stored router weight of a MoE layer."""
    if arch == "gpt_oss":
        return f"model.layers.{layer}.mlp.router.weight"
    module = "block_sparse_moe" if arch == "mixtral" else "mlp"
    return f"model.layers.{layer}.{module}.gate.weight"


def expert_names(arch: str, layer: int, expert: int) -> tuple[str, str, str]:
    """The stored (gate, up, down) names of a routed expert."""
    if arch == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def n_experts(config) -> int:
    """Routed experts per MoE layer of a transformers config of any architecture."""
    if config.model_type in SOFTMAX_ARCHS:
        return config.num_local_experts if config.model_type == "mixtral" else config.num_experts
    return config.n_routed_experts


def expert_width(config) -> int:
    """A routed expert's FFN width (Mixtral and OLMoE call it intermediate_size)."""
    if config.model_type in ("mixtral", "olmoe", "gpt_oss"):
        return config.intermediate_size
    return config.moe_intermediate_size


def moe_layer_indices(config) -> list[int]:
    """The MoE layers of a transformers config, as its decoder layers decide them."""
    n = config.num_hidden_layers
    if config.model_type == "qwen3_moe":
        step = config.decoder_sparse_step
        return [i for i in range(n) if i not in config.mlp_only_layers and (i + 1) % step == 0]
    if config.model_type in SOFTMAX_ARCHS:
        return list(range(n))
    return list(range(config.first_k_dense_replace, n))


def _fp8_eligible(name: str, t: torch.Tensor) -> bool:
    if t.ndim != 2 or not name.endswith(".weight"):
        return False
    skip = (
        "embed_tokens.weight",
        "lm_head.weight",
        "mlp.gate.weight",
        "block_sparse_moe.gate.weight",
        "mlp.router.weight",
        "weights_proj.weight",
        "eh_proj.weight",
        "shared_head.head.weight",
    )
    return not any(name.endswith(s) for s in skip) and "norm" not in name.rsplit(".", 2)[-2]


def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise 128x128 e4m3 quantisation.

    Returns (fp8 [O, I], scale_inv f32 [ceil(O/128), ceil(I/128)]); scale_inv = block absmax / 448.
    """
    o, i = w.shape
    bo, bi = -(-o // FP8_BLOCK), -(-i // FP8_BLOCK)
    pad = torch.zeros(bo * FP8_BLOCK, bi * FP8_BLOCK, dtype=torch.float32)
    pad[:o, :i] = w.float()
    blocks = pad.view(bo, FP8_BLOCK, bi, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(bo * FP8_BLOCK, bi * FP8_BLOCK)[:o, :i].contiguous(), scale_inv


def fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    o, i = q.shape
    s = scale_inv.repeat_interleave(FP8_BLOCK, 0)[:o].repeat_interleave(FP8_BLOCK, 1)[:, :i]
    return q.float() * s


def _encode(
    tensors: dict,
    dtype: str,
    expert_transform: ExpertTransform | None,
    expert_container: ExpertContainer | None,
) -> tuple[dict, dict]:
    """Returns (stored tensors as written, effective float32 values the reference uses)."""
    stored, effective = {}, {}
    custom_experts = expert_transform is not None or expert_container is not None
    for name in sorted(tensors):
        t = tensors[name].float().contiguous()
        if custom_experts and is_routed_expert(name):
            w = t.numpy()
            w_eff = w
            if expert_transform is not None:
                w_eff = np.ascontiguousarray(expert_transform(name, w.copy()), dtype=np.float32)
                assert w_eff.shape == w.shape, (name, w_eff.shape, w.shape)
            effective[name] = torch.from_numpy(w_eff.copy())
            if expert_container is not None:
                for k, v in expert_container(name, w.copy()).items():
                    # a torch tensor is stored as-is (bf16 / fp8 encodings numpy lacks)
                    stored[k] = (
                        v.contiguous()
                        if isinstance(v, torch.Tensor)
                        else torch.from_numpy(np.ascontiguousarray(v))
                    )
            else:
                stored[name] = effective[name].clone()
            continue
        if dtype == "f32" or name.endswith("e_score_correction_bias"):
            stored[name], effective[name] = t, t
        elif dtype == "bf16":
            stored[name] = t.to(torch.bfloat16)
            effective[name] = stored[name].float()
        elif dtype == "fp8":
            if _fp8_eligible(name, t):
                q, s = fp8_quantize(t)
                stored[name], stored[name + "_scale_inv"] = q, s
                effective[name] = fp8_dequantize(q, s)
            else:
                stored[name], effective[name] = t, t
        else:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    return stored, effective


def split_gpt_oss(tensors: dict) -> dict:
    """gpt-oss's fused expert tensors as per-expert matrices (the converter's split)."""
    out = {}
    for name, t in tensors.items():
        if gpt_oss_convert.is_fused(name):
            for k, v in gpt_oss_convert.split_fused(name, t.float().numpy()).items():
                out[k] = torch.from_numpy(v)
        else:
            out[name] = t
    return out


_PER_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$"
)


def fuse_gpt_oss(tensors: dict) -> dict:
    """The inverse of ``split_gpt_oss`` (float32): transformers' fused layout back, so the
    reference model loads what the engine's folder holds."""
    out, parts = {}, {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            parts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t.float()
    for prefix, mats in parts.items():
        n = 1 + max(e for e, _ in mats)
        gate_up = []
        for e in range(n):
            gate, up = mats[(e, "gate")].T, mats[(e, "up")].T  # [D, F] each
            gate_up.append(torch.stack([gate, up], dim=-1).reshape(gate.shape[0], -1))
        out[f"{prefix}.gate_up_proj"] = torch.stack(gate_up).contiguous()
        out[f"{prefix}.down_proj"] = torch.stack(
            [mats[(e, "down")].T for e in range(n)]
        ).contiguous()
    return out


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)


def mxfp4_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., I] float -> (blocks U8 [..., I/32, 16], scales U8 [..., I/32]): per 32 inputs
    the smallest power of two 2^k with absmax / 2^k <= 6, each value rounded to the nearest
    e2m1 magnitude (ties to the lower code), sign in bit 3; the even element low."""
    g = w.reshape(*w.shape[:-1], -1, 32).astype(np.float64)
    absmax = np.abs(g).max(axis=-1)
    k = np.ceil(np.log2(np.maximum(absmax, 1e-30) / 6.0)).astype(np.int64)
    k = np.clip(k, -127, 127)
    scaled = np.abs(g) / np.exp2(k)[..., None]
    code = np.abs(scaled[..., None] - E2M1).argmin(axis=-1)  # 0..7
    code = code | np.where(g < 0, 8, 0)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return packed, (k + 127).astype(np.uint8)


def mxfp4_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    signed = np.concatenate([E2M1, -E2M1])
    vals = np.stack([signed[blocks & 15], signed[blocks >> 4]], axis=-1).reshape(
        *blocks.shape[:-1], -1
    )
    out = vals * np.exp2(scales.astype(np.float64) - 127)[..., None]
    return out.reshape(*out.shape[:-2], -1).astype(np.float32)


def write_mxfp4_source(folder: Path, dst: Path, check: Callable | None = None) -> Path:
    """A gpt-oss oracle folder (per-expert f32) re-stored as OpenAI ships gpt-oss: the
    experts fused per layer and in MXFP4 (``*_blocks`` / ``*_scales``, [out, in]), the
    rest as it is; `check(blocks, scales, fused)` sees each encoded tensor."""
    dst.mkdir(parents=True)
    fused = fuse_gpt_oss(load_file(str(Path(folder) / "model.safetensors")))
    out = {}
    for name, t in fused.items():
        a = t.numpy()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_encode(np.ascontiguousarray(a.transpose(0, 2, 1)))
            if check is not None:
                check(blocks, scales, a)
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        else:
            out[name] = a
    from safetensors.numpy import save_file as save_numpy

    save_numpy(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(folder) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def dequantize_folder_tensors(folder: Path) -> dict:
    """All tensors of an oracle folder as float32 (fp8 blocks dequantised, scale_inv dropped)."""
    raw = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        raw.update(load_file(str(f)))
    out = {}
    for k, v in raw.items():
        if k.endswith("_scale_inv"):
            continue
        if v.dtype == torch.float8_e4m3fn:
            out[k] = fp8_dequantize(v, raw[k + "_scale_inv"])
        else:
            out[k] = v.float()
    return out


def tensor_table(folder: Path) -> list[tuple[str, str, tuple, str]]:
    """(name, dtype, shape, file) for every tensor stored in ``folder``."""
    rows = []
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                rows.append((k, sl.get_dtype(), tuple(sl.get_shape()), f.name))
    return sorted(rows)


# ----------------------------------------------------------------------------- reference


def load_reference_model(folder: Path, config=None):
    """transformers model (float32, eager) from an f32/bf16 oracle folder (ignores MTP weights)."""
    arch = json.loads((Path(folder) / "config.json").read_text())["model_type"]
    cls = getattr(transformers, _CLASSES[arch][1])
    kw = {"config": config} if config is not None else {}
    model = cls.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager", **kw)
    return model.eval()


def load_reference_model_any(folder: Path, config=None):
    """Like ``load_reference_model`` but also for fp8 folders (dequantised by hand, since
    transformers' fp8 loader needs accelerate/GPU)."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    if "quantization_config" not in cfg and cfg["model_type"] != "gpt_oss":
        return load_reference_model(folder, config)
    tensors = dequantize_folder_tensors(folder)
    if cfg["model_type"] == "gpt_oss":  # the folder holds the per-expert split
        tensors = fuse_gpt_oss(tensors)
    with tempfile.TemporaryDirectory() as tmp:
        cfg.pop("quantization_config", None)
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        n = cfg["num_hidden_layers"]
        main = {k: v for k, v in tensors.items() if not k.startswith(f"model.layers.{n}.")}
        save_file(main, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        return load_reference_model(Path(tmp), config)


def stable_topk(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """``torch.topk`` with ties to the lower index: a stable sort, cut after ``k``."""
    order = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk(
        (order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k))
    )


class _StableTopkMode(TorchFunctionMode):
    """Routes ``torch.topk`` / ``Tensor.topk`` to ``stable_topk`` while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.topk or func is torch.Tensor.topk:
            return stable_topk(*args, **kwargs)
        return func(*args, **kwargs)


def _under_stable_topk(forward):
    def pinned(*args, **kwargs):
        with _StableTopkMode():
            return forward(*args, **kwargs)

    return pinned


def pin_dsa_ties(model) -> bool:
    """Pin the DSA top-k tie rule of a transformers GLM-5 / DeepSeek-V3.2 model to "the earlier
    position wins"
    (see the note at DEFAULT_SEEDS). Only the indexer's own top-k is affected: its scores are
    computed by transformers' code unchanged. Returns whether the model has an indexer."""
    found = False
    for layer in model.model.layers:
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is None:
            continue
        found = True
        if not getattr(indexer, "_ties_pinned", False):
            indexer.forward = _under_stable_topk(indexer.forward)
            indexer._ties_pinned = True
    return found


def indexer_rope(model_type: str) -> Callable:
    """transformers' RoPE function of the DSA indexer of ``model_type``: ``(q, k, cos, sin,
    unsqueeze_dim) -> (q, k)``; GLM-5 interleaves, DeepSeek-V3.2 uses rotate_half."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm5

    return {
        "glm_moe_dsa": glm5.apply_rotary_pos_emb_interleave,
        "deepseek_v32": v32.apply_rotary_pos_emb,
    }[model_type]


def _top2_gap(logits: torch.Tensor) -> float:
    top = logits.float().topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


class _Probe:
    """Forward hooks recording routing and DSA selection margins (diagnostics only)."""

    def __init__(self, model, ties_pinned: bool = False):
        self.model = model
        self.ties_pinned = ties_pinned
        self.dsa_tied_rows = 0
        self.handles = []
        self.routing: dict[int, list] = {}
        self.router_margin = math.inf
        self.group_margin = math.inf
        self.dsa_margin = math.inf
        self.dsa_rows_selecting = 0
        cfg = model.config
        hook = self._softmax_router_hook if cfg.model_type in SOFTMAX_ARCHS else self._router_hook
        if cfg.model_type == "gpt_oss":
            hook = self._logit_router_hook
        for i, layer in enumerate(model.model.layers):
            gate = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
            if gate is not None:
                self.handles.append(gate.register_forward_hook(hook(i, gate)))
            idx = getattr(layer.self_attn, "indexer", None)
            if idx is not None:
                self.handles.append(
                    idx.register_forward_hook(self._indexer_hook(idx, cfg), with_kwargs=True)
                )

    def close(self):
        for h in self.handles:
            h.remove()

    def _softmax_router_hook(self, layer_idx, gate):
        # margin between the k-th chosen and the best unchosen softmax probability
        def hook(mod, args, out):
            _, _, topk_idx = out
            x = args[0].reshape(-1, mod.hidden_dim).float()
            probs = torch.softmax(x @ mod.weight.float().T, dim=-1)
            sel = torch.zeros_like(probs, dtype=torch.bool).scatter(1, topk_idx, True)
            kth = probs.masked_fill(~sel, math.inf).min(-1).values
            nxt = probs.masked_fill(sel, -math.inf).max(-1).values
            if probs.shape[-1] > topk_idx.shape[-1]:
                self.router_margin = min(self.router_margin, float((kth - nxt).min()))
            self.routing.setdefault(layer_idx, []).extend(
                tuple(sorted(r)) for r in topk_idx.tolist()
            )

        return hook

    def _logit_router_hook(self, layer_idx, gate):
        # gpt-oss: top-k of the (biased) logits; margin between the k-th and the next
        def hook(mod, args, out):
            logits, _, topk_idx = out
            srt = logits.float().sort(dim=-1, descending=True).values
            k = topk_idx.shape[-1]
            if srt.shape[-1] > k:
                self.router_margin = min(
                    self.router_margin, float((srt[:, k - 1] - srt[:, k]).min())
                )
            self.routing.setdefault(layer_idx, []).extend(
                tuple(sorted(r)) for r in topk_idx.tolist()
            )

        return hook

    def _router_hook(self, layer_idx, gate):
        def hook(mod, args, out):
            _, _, topk_idx = out
            x = args[0].reshape(-1, mod.hidden_dim).float()
            scores = torch.sigmoid(x @ mod.weight.float().T) + mod.e_score_correction_bias
            g = scores.view(-1, mod.num_group, mod.num_experts // mod.num_group)
            gs = g.topk(2, dim=-1).values.sum(-1)
            if mod.topk_group < mod.num_group:
                s = gs.sort(dim=-1, descending=True).values
                self.group_margin = min(
                    self.group_margin,
                    float((s[:, mod.topk_group - 1] - s[:, mod.topk_group]).min()),
                )
            sel = torch.zeros_like(scores, dtype=torch.bool).scatter(1, topk_idx, True)
            allowed = gs.topk(mod.topk_group, dim=-1).indices
            gmask = torch.zeros_like(gs, dtype=torch.bool).scatter(1, allowed, True)
            emask = gmask.repeat_interleave(mod.num_experts // mod.num_group, dim=1)
            kth = scores.masked_fill(~sel, math.inf).min(-1).values
            nxt = scores.masked_fill(sel | ~emask, -math.inf).max(-1).values
            self.router_margin = min(self.router_margin, float((kth - nxt).min()))
            self.routing.setdefault(layer_idx, []).extend(
                tuple(sorted(r)) for r in topk_idx.tolist()
            )

        return hook

    def _indexer_hook(self, mod, cfg):
        # Re-derive the index scores (same formula as GlmMoeDsaIndexer / DeepseekV32Indexer
        # .forward, each with its RoPE layout) to measure the margin between the k-th and
        # (k+1)-th selected key of every query that really selects.
        rotate = indexer_rope(cfg.model_type)

        def hook(m, args, kwargs, out):
            hidden, q_resid, pos, mask = (list(args) + [None] * 4)[:4]
            hidden = kwargs.get("hidden_states", hidden)
            q_resid = kwargs.get("q_resid", q_resid)
            pos = kwargs.get("position_embeddings", pos)
            mask = kwargs.get("attention_mask", mask)
            cache = kwargs.get("cache")
            b, s, _ = hidden.shape
            with torch.no_grad():
                q = m.wq_b(q_resid).view(b, s, m.n_heads, m.head_dim)
                rope = m.qk_rope_head_dim
                if cache is not None:
                    k = cache.layers[m.layer_idx].indexer_keys  # already updated by the forward
                else:
                    k = m.k_norm(m.wk(hidden)).unsqueeze(2)
                    kr, kp = k.split([rope, m.head_dim - rope], -1)
                    _, kr = rotate(kr[..., :1, :], kr, *pos, unsqueeze_dim=2)
                    k = torch.cat([kr, kp], -1).squeeze(2)
                qr, qp = q.split([rope, m.head_dim - rope], -1)
                qr, _ = rotate(qr, qr[..., :1, :], *pos, unsqueeze_dim=2)
                q = torch.cat([qr, qp], -1)
                sc = q.float() @ k.transpose(-1, -2).float().unsqueeze(1)
                sc = torch.relu(sc * m.softmax_scale)
                w = m.weights_proj(hidden.float()).float() * m.n_heads**-0.5
                idx = (w.unsqueeze(-2) @ sc).squeeze(-2)  # [B, S, T]
                t = idx.shape[-1]
                if mask.dtype == torch.bool:
                    valid = mask
                else:
                    valid = mask == 0
                valid = valid.expand(b, s, t)
                nvalid = valid.sum(-1)
                rows = nvalid > m.index_topk
                if rows.any():
                    srt = idx.masked_fill(~valid, -math.inf).sort(-1, descending=True).values
                    gap = srt[..., m.index_topk - 1] - srt[..., m.index_topk]
                    self.dsa_margin = min(self.dsa_margin, float(gap[rows].min()))
                    self.dsa_rows_selecting += int(rows.sum())
                    tied = rows & (gap == 0)
                    self.dsa_tied_rows += int(tied.sum())
                    # my re-derivation must select exactly what transformers selected (on a
                    # tied row only when the tie rule is pinned: torch's own is unspecified)
                    scores = idx.masked_fill(~valid, -math.inf)
                    mine = stable_topk(scores, min(m.index_topk, t), -1).indices
                    theirs = out.long()
                    check = rows if self.ties_pinned else rows & ~tied
                    for r in check.nonzero().tolist():
                        assert set(mine[tuple(r)].tolist()) == set(theirs[tuple(r)].tolist())

        return hook


def _reference(model, prompt_ids, tf_ids, *, gen_len=GEN_LEN, pin_ties=True):
    """(tf_logits, greedy, greedy_logits, diagnostics, tf_ids); ``tf_ids=None`` teacher-forces
    the prompt followed by the greedy continuation but its last token."""
    pinned = pin_ties and pin_dsa_ties(model)
    probe = _Probe(model, ties_pinned=pinned)
    try:
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=gen_len,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            greedy = gen.sequences[0, len(prompt_ids) :].tolist()
            if tf_ids is None:
                tf_ids = list(prompt_ids) + greedy[:-1]
            probe.routing.clear()
            out = model(torch.tensor([tf_ids]), use_cache=False)
            tf_logits = out.logits[0].float()
            routing_tf = {k: list(v) for k, v in probe.routing.items()}
    finally:
        probe.close()
    greedy_logits = torch.cat([x.float() for x in gen.logits], 0)
    cfg = model.config
    diag = {
        "router_min_margin": probe.router_margin,
        "router_group_min_margin": probe.group_margin if probe.group_margin != math.inf else None,
        "distinct_expert_sets_tf": {str(k): len(set(v)) for k, v in routing_tf.items()},
        "experts_used_tf": {str(k): len({e for r in v for e in r}) for k, v in routing_tf.items()},
        "moe_layers": sorted(routing_tf),
    }
    if cfg.model_type in DSA_ARCHS:
        diag["dsa_min_topk_gap"] = probe.dsa_margin
        diag["dsa_rows_selecting"] = probe.dsa_rows_selecting
        diag["dsa_tied_rows"] = probe.dsa_tied_rows
        diag["dsa_ties_pinned"] = pinned
    return tf_logits, greedy, greedy_logits, diag, tf_ids


def build_checkpoint(
    arch: str,
    out_dir: Path,
    *,
    dtype: str = "f32",
    seed: int | None = None,
    expert_transform: ExpertTransform | None = None,
    expert_container: ExpertContainer | None = None,
    with_mtp: bool = True,
    config_overrides: dict | None = None,
    prompt_len: int = PROMPT_LEN,
    tf_len: int | None = TF_LEN,
    gen_len: int = GEN_LEN,
    pin_ties: bool = True,
) -> OracleReference:
    """Build the tiny ``arch`` checkpoint into ``out_dir`` and compute its float32 reference.

    ``seed=None`` uses ``DEFAULT_SEEDS[arch]``. ``with_mtp`` only adds an MTP layer to the
    architectures that have one (``MTP_ARCHS``). ``config_overrides`` go to ``tiny_config``.
    ``tf_len=None`` teacher-forces the prompt plus the greedy continuation (the config sweep)
    instead of a separate random sequence. ``pin_ties`` pins the DSA top-k tie rule (see the
    note at DEFAULT_SEEDS); ``False`` is transformers exactly as shipped.
    """
    if seed is None:
        seed = DEFAULT_SEEDS[arch]
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with_mtp = with_mtp and arch in MTP_ARCHS
    overrides = dict(config_overrides or {})
    if arch in MTP_ARCHS:
        overrides.setdefault("num_nextn_predict_layers", 1 if with_mtp else 0)
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    cls = getattr(transformers, _CLASSES[arch][1])
    model = cls(config).eval()
    _init_model(model, seed)
    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(2, config.vocab_size, prompt_len).tolist()
    tf_ids = None if tf_len is None else rng.integers(2, config.vocab_size, tf_len).tolist()

    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "stage"
        model.save_pretrained(str(stage), safe_serialization=True)
        files = sorted(stage.glob("*.safetensors"))
        assert [f.name for f in files] == ["model.safetensors"], files
        main = load_file(str(files[0]))
        if arch == "gpt_oss":  # stored as colibri convert writes it, per expert
            main = split_gpt_oss(main)
        mtp = {}
        if with_mtp:
            mtp = _mtp_tensors(main, config, torch.Generator().manual_seed(seed + 1))
        stored, effective = _encode(main, dtype, expert_transform, expert_container)
        mtp_stored, _ = _encode(mtp, dtype, None, None)

        # The reference model is what transformers loads from the effective f32 values.
        eff_dir = Path(tmp) / "effective"
        eff_dir.mkdir()
        shutil.copy(stage / "config.json", eff_dir / "config.json")
        if arch == "gpt_oss":
            effective = fuse_gpt_oss(effective)
        save_file(effective, str(eff_dir / "model.safetensors"), metadata={"format": "pt"})
        ref_model = load_reference_model(eff_dir)
        tf_logits, greedy, greedy_logits, diag, tf_ids = _reference(
            ref_model, prompt_ids, tf_ids, gen_len=gen_len, pin_ties=pin_ties
        )

        for f in out_dir.glob("*.safetensors"):
            f.unlink()
        for name in ("config.json", "generation_config.json"):
            if (stage / name).exists():
                shutil.copy(stage / name, out_dir / name)
    if dtype == "fp8":
        cfg = json.loads((out_dir / "config.json").read_text())
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    meta = {"format": "pt"}
    index = out_dir / INDEX_FILE
    if index.exists():
        index.unlink()
    if with_mtp:
        save_file(stored, str(out_dir / MAIN_SHARD), metadata=meta)
        save_file(mtp_stored, str(out_dir / MTP_SHARD), metadata=meta)
        total = sum(t.numel() * t.element_size() for t in (*stored.values(), *mtp_stored.values()))
        weight_map = {k: MAIN_SHARD for k in stored} | {k: MTP_SHARD for k in mtp_stored}
        index.write_text(
            json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                indent=2,
            )
            + "\n"
        )
    else:
        save_file(stored, str(out_dir / "model.safetensors"), metadata=meta)

    np.save(out_dir / "tf_logits.npy", tf_logits.numpy().astype(np.float32))
    np.save(out_dir / "greedy_logits.npy", greedy_logits.numpy().astype(np.float32))
    ref = OracleReference(
        arch=arch,
        dtype=dtype,
        out_dir=out_dir,
        prompt_ids=prompt_ids,
        greedy_ids=greedy,
        tf_ids=tf_ids,
        tf_pred=tf_logits.argmax(-1).tolist(),
        tf_logits_top2_gap=_top2_gap(tf_logits),
        greedy_logits_top2_gap=_top2_gap(greedy_logits),
        transformers_version=transformers.__version__,
        seed=seed,
        with_mtp=with_mtp,
        num_hidden_layers=config.num_hidden_layers,
        diagnostics=diag,
    )
    (out_dir / "oracle.json").write_text(json.dumps(ref.to_json(), indent=2) + "\n")
    return ref
