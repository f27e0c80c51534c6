"""Config sweep for the oracle: seeded draws across each architecture's valid config space.

Why: one hand-written tiny config per architecture proved exactness on that config only; GLM-5's
sparse attention diverged on the first config a user tried that was unlike it (issue 13). Each
drawn case builds a random transformers model (``tiny_models.build_checkpoint``), the engine
loads it from disk, and ``check_case`` requires, at f32:

* teacher-forced argmax over prompt + continuation equal to transformers' full forward at every
  position;
* greedy tokens (prefill + decode with the KV cache) equal to transformers' ``generate``;
* the engine's incremental decode equal to its own prefill (greedy == teacher-forced argmax at
  the generated positions, as far as both saw the same tokens), and the same of the reference
  (else the case is ill-conditioned).

A case is plain JSON (``SweepCase.to_json``): a failure prints it ready to paste into
``REGRESSIONS`` of ``test_sweep.py``. Plain module (no pytest imports) so scripts can use it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import tiny_models

from colibrid.backends.base import KernelFamily
from colibrid.engine.engine import Engine
from colibrid.engine.generate import DoneEvent, TokenEvent, generate, teacher_forced_argmax
from colibrid.engine.sampling import SamplingParams

GEN_LEN = tiny_models.GEN_LEN
# Keys a case does not set come from tiny_models' base config. Cases leave the MTP layer out:
# transformers ignores it, so it has no reference to compare with.
MAX_POSITIONS = 256


@dataclasses.dataclass(frozen=True)
class SweepCase:
    """One drawn configuration: what ``check_case`` needs to rebuild it exactly."""

    arch: str
    seed: int
    prompt_len: int
    overrides: dict[str, Any]
    # config.json keys removed after saving, so the engine derives them the way transformers
    # does from the remaining keys (e.g. "indexer_types" from "index_topk_pattern")
    drop_keys: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SweepCase:
        d = json.loads(text)
        return cls(
            arch=d["arch"],
            seed=int(d["seed"]),
            prompt_len=int(d["prompt_len"]),
            overrides=dict(d["overrides"]),
            drop_keys=tuple(d.get("drop_keys", ())),
        )


# ----------------------------------------------------------------------------- drawing


def draw_case(arch: str, index: int) -> SweepCase:
    """The ``index``-th case of ``arch``: the same on every machine and Python run (the RNG is
    seeded from a string, which does not depend on PYTHONHASHSEED)."""
    rng = random.Random(f"colibri-sweep/{arch}/{index}")
    prompt_len = rng.randint(3, 24)
    if arch in tiny_models.SOFTMAX_ARCHS:
        overrides = _draw_softmax_family(rng, arch, prompt_len + GEN_LEN)
        return SweepCase(arch, rng.randint(1, 10_000), prompt_len, overrides)
    overrides = _draw_trunk(rng)
    drop: tuple[str, ...] = ()
    if arch == "glm_moe_dsa":
        overrides.update(_draw_mla(rng, q_lora_optional=False))
        dsa, drop = _draw_dsa(
            rng, overrides["num_hidden_layers"], prompt_len + GEN_LEN, overrides["qk_rope_head_dim"]
        )
        overrides.update(dsa)
    elif arch == "deepseek_v32":
        overrides.update(_draw_mla(rng, q_lora_optional=False))
        context = prompt_len + GEN_LEN
        overrides.update(_draw_indexer(rng, context, overrides["qk_rope_head_dim"]))
    elif arch == "deepseek_v3":
        overrides.update(_draw_mla(rng, q_lora_optional=True))
        overrides["rope_interleave"] = rng.random() < 0.6
    elif arch == "glm4_moe":
        overrides.update(_draw_gqa(rng, overrides["rope_parameters"]))
    else:
        raise ValueError(f"unknown arch {arch!r}")
    return SweepCase(arch, rng.randint(1, 10_000), prompt_len, overrides, drop)


def _draw_trunk(rng: random.Random) -> dict[str, Any]:
    """Sizes, dense/MoE layer split and group-limited routing, shared by the sigmoid-routed
    families."""
    layers = rng.randint(1, 4)
    n_group = rng.choice([1, 1, 2, 4])
    per_group = rng.randint(2, 6)
    topk_group = rng.randint(1, n_group)
    theta = rng.choice([10_000.0, 50_000.0, 1_000_000.0])
    return dict(
        vocab_size=rng.choice([96, 160, 256]),
        hidden_size=rng.choice([32, 48, 64, 96, 128]),
        intermediate_size=rng.choice([32, 64, 96, 160]),
        moe_intermediate_size=rng.choice([16, 32, 48, 64]),
        num_hidden_layers=layers,
        first_k_dense_replace=rng.randint(0, layers - 1),  # at least one MoE layer
        n_routed_experts=n_group * per_group,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=rng.randint(1, min(8, topk_group * per_group)),
        n_shared_experts=rng.randint(1, 2),
        norm_topk_prob=rng.random() < 0.7,
        routed_scaling_factor=round(rng.uniform(0.5, 3.0), 2),
        rms_norm_eps=rng.choice([1e-5, 1e-6]),
        tie_word_embeddings=rng.random() < 0.2,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters=_draw_rope(rng, theta),
    )


def _draw_rope(rng: random.Random, theta: float) -> dict[str, Any]:
    if rng.random() < 0.75:
        return {"rope_type": "default", "rope_theta": theta}
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": rng.choice([2.0, 4.0]),
        "original_max_position_embeddings": MAX_POSITIONS // 4,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": rng.choice([0.0, 1.0]),
    }


def _draw_mla(rng: random.Random, *, q_lora_optional: bool) -> dict[str, Any]:
    heads = rng.randint(1, 6)
    q_lora = None if q_lora_optional and rng.random() < 0.4 else rng.choice([16, 32, 48, 96])
    return dict(
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=rng.choice([16, 32, 64]),
        qk_nope_head_dim=rng.choice([4, 8, 16, 32]),
        qk_rope_head_dim=rng.choice([2, 4, 8, 16]),
        v_head_dim=rng.choice([4, 8, 16, 32]),
        attention_bias=rng.random() < 0.3,
    )


def _draw_dsa(
    rng: random.Random, layers: int, context: int, rope: int
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """GLM-5: the indexer (``_draw_indexer``) and the full/shared layer pattern, given as an
    explicit list, as an F/S pattern string, or as the freq/offset schedule."""
    out = _draw_indexer(rng, context, rope)
    kinds = ["full"] + [rng.choice(["full", "shared"]) for _ in range(layers - 1)]
    style = rng.choice(["list", "list", "pattern", "schedule"])
    drop: tuple[str, ...] = ()
    out["indexer_types"] = kinds if style == "list" else None  # None: derived by transformers
    if style == "pattern":
        out["index_topk_pattern"] = "".join(k[0].upper() for k in kinds)
        drop = ("indexer_types",)
    elif style == "schedule":
        out["index_topk_freq"] = rng.randint(1, 3)
        out["index_skip_topk_offset"] = rng.randint(1, 3)
        drop = ("indexer_types",)
    return out, drop


def _draw_indexer(rng: random.Random, context: int, rope: int) -> dict[str, Any]:
    """The DSA indexer shared by GLM-5 and DeepSeek-V3.2: its shape (index_head_dim from
    exactly the rotary part up, so also equal to and unlike 2 x rope) and top-k (1 to above the
    context, so most cases select), plus a `rope_interleave` key both transformers models
    ignore (their MLA always interleaves)."""
    return dict(
        index_n_heads=rng.randint(1, 8),
        index_head_dim=rope + rng.choice([0, 2, rope, 6, 16, 40]),
        index_topk=rng.randint(1, context + 4),
        rope_interleave=rng.random() < 0.8,
    )


def _draw_gqa(rng: random.Random, rope: dict[str, Any]) -> dict[str, Any]:
    """GQA ratio, head_dim, qk-norm, bias and the partial rotary factor (sometimes left out,
    which transformers' Glm4MoeConfig reads as 0.5) for an even rotary width."""
    heads = rng.randint(1, 8)
    head_dim = rng.choice([8, 16, 24, 32, 48, 64])
    factors = [f for f in (0.25, 0.5, 0.75, 1.0) if int(head_dim * f) % 2 == 0]
    partial = rng.choice(factors + [None])
    rope = dict(rope)
    if partial is not None or int(head_dim * 0.5) % 2:
        rope["partial_rotary_factor"] = partial if partial is not None else 1.0
    return dict(
        num_attention_heads=heads,
        num_key_value_heads=rng.choice([d for d in range(1, heads + 1) if heads % d == 0]),
        head_dim=head_dim,
        use_qk_norm=rng.random() < 0.5,
        attention_bias=rng.random() < 0.5,
        rope_parameters=rope,
    )


def _draw_softmax_family(rng: random.Random, arch: str, context: int) -> dict[str, Any]:
    """A Qwen3-MoE, Mixtral, OLMoE or gpt-oss config: sizes, experts and top-k (softmax
    routing, no groups or shared experts), GQA heads and the family's own options: Qwen3-MoE's
    dense layers, per-head qk-norm width, bias and windowing; Mixtral's sliding window (none,
    or from one key to past the context) and implicit head_dim; OLMoE's whole-projection
    qk-norm (head_dim = hidden / heads), bias and norm_topk_prob; gpt-oss's sliding and full
    layers, window shorter than the context, biases and clamped-SwiGLU constants."""
    layers = rng.randint(1, 4)
    hidden = rng.choice([32, 48, 64, 96, 128])
    experts = rng.randint(2, 16)
    theta = rng.choice([10_000.0, 50_000.0, 1_000_000.0])
    implicit = {"qwen3_moe": 0.0, "mixtral": 0.6, "olmoe": 1.0, "gpt_oss": 0.0}[arch]
    heads, kv_heads, head_dim = _draw_heads(rng, hidden, implicit)
    out: dict[str, Any] = dict(
        vocab_size=rng.choice([96, 160, 256]),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_experts_per_tok=rng.randint(1, min(8, experts)),
        rms_norm_eps=rng.choice([1e-5, 1e-6]),
        tie_word_embeddings=rng.random() < 0.2,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters=_draw_rope(rng, theta),
    )
    width = rng.choice([16, 32, 48, 64, 96, 160])
    # from 2 keys: at 1, transformers' cached generate contradicts its own full forward
    # (its sliding cache keeps every key), see NUMERICS.md
    window = rng.randint(2, context + 4)
    if arch == "qwen3_moe":
        step = rng.randint(1, min(3, layers))
        keep = rng.choice([i for i in range(layers) if (i + 1) % step == 0])  # one MoE layer
        out.update(
            head_dim=head_dim,
            num_experts=experts,
            moe_intermediate_size=width,
            intermediate_size=rng.choice([32, 64, 96, 160]),
            decoder_sparse_step=step,
            mlp_only_layers=[i for i in range(layers) if i != keep and rng.random() < 0.3],
            norm_topk_prob=rng.random() < 0.7,
            attention_bias=rng.random() < 0.3,
            use_sliding_window=rng.random() < 0.3,
            sliding_window=window,
        )
    elif arch == "mixtral":
        if head_dim is None and out["rope_parameters"]["rope_type"] == "yarn":
            # transformers' YaRN reads a null head_dim as is and fails: spell it out
            head_dim = hidden // heads
        out.update(
            head_dim=head_dim,  # None: hidden / heads
            num_local_experts=experts,
            intermediate_size=width,
            sliding_window=window if rng.random() < 0.6 else None,
        )
    elif arch == "olmoe":
        out.update(
            num_experts=experts,
            intermediate_size=width,
            norm_topk_prob=rng.random() < 0.3,
            attention_bias=rng.random() < 0.3,
        )
    elif arch == "gpt_oss":
        out.update(_draw_gpt_oss(rng, layers, context, theta), head_dim=head_dim)
        out.update(num_local_experts=experts, intermediate_size=width)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    return out


def _draw_gpt_oss(rng: random.Random, layers: int, context: int, theta: float) -> dict[str, Any]:
    """gpt-oss's own options: `layer_types` (the default alternation or a random mix), a
    window from 2 keys to shorter than the context, biases on or off, the clamp limit low
    enough to bite on tiny activations, and the real models' YaRN shape (truncate off)."""
    kinds = ("sliding_attention", "full_attention")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if rng.random() < 0.5:
        rope = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": rng.choice([2.0, 4.0, 32.0]),
            "original_max_position_embeddings": MAX_POSITIONS // 4,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": rng.random() < 0.3,
        }
    return dict(
        layer_types=[rng.choice(kinds) for _ in range(layers)] if rng.random() < 0.5 else None,
        sliding_window=rng.randint(2, context - 2),
        attention_bias=rng.random() < 0.8,
        swiglu_alpha=rng.choice([1.702, 1.0, 2.5]),
        swiglu_limit=rng.choice([0.5, 1.0, 2.0, 7.0]),
        rope_parameters=rope,
    )


def _draw_heads(rng: random.Random, hidden: int, implicit: float) -> tuple[int, int, int | None]:
    """(heads, KV heads dividing them, head_dim). With probability ``implicit`` head_dim is
    None, meaning hidden / heads, and the heads are drawn so that it is exact and even (for
    RoPE); otherwise it is drawn on its own."""
    if rng.random() < implicit:
        heads = rng.choice([h for h in range(1, 9) if hidden % h == 0 and hidden // h % 2 == 0])
        head_dim = None
    else:
        heads = rng.randint(1, 8)
        head_dim = rng.choice([8, 16, 24, 32, 48, 64])
    kv_heads = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    return heads, kv_heads, head_dim


# ----------------------------------------------------------------------------- checking


@dataclasses.dataclass
class CaseOutcome:
    case: SweepCase
    ref: tiny_models.OracleReference
    tf: list[int]
    greedy: list[int]
    problems: list[str]

    def first_gap(self) -> float:
        """The reference's top-1/top-2 logit gap where the engine first disagrees with it
        (the smaller of teacher-forced and greedy); inf when it agrees everywhere."""
        gaps = []
        if self.tf != self.ref.tf_pred:
            gaps.append(_gap(self.ref.tf_logits[_first_diff(self.tf, self.ref.tf_pred)]))
        i = _first_diff(self.greedy, self.ref.greedy_ids)
        if i < len(self.ref.greedy_ids):
            gaps.append(_gap(self.ref.greedy_logits[i]))
        return min(gaps, default=math.inf)

    def report(self) -> str:
        lines = [f"{self.case.arch} sweep case failed:", *self.problems]
        lines.append(f"reference diagnostics: {json.dumps(self.ref.diagnostics, default=str)}")
        lines.append("paste into REGRESSIONS (tests/oracle/test_sweep.py):")
        lines.append(f"    {self.case.to_json()!r},")
        return "\n".join(lines)


def build_case(case: SweepCase, out_dir: Path, **build_kw: Any) -> tiny_models.OracleReference:
    """Checkpoint + reference of a case in ``out_dir`` (``build_kw`` go to build_checkpoint)."""
    ref = tiny_models.build_checkpoint(
        case.arch,
        out_dir,
        seed=case.seed,
        with_mtp=False,
        config_overrides=dict(case.overrides),
        prompt_len=case.prompt_len,
        tf_len=None,
        **build_kw,
    )
    if case.drop_keys:
        path = Path(out_dir) / "config.json"
        config = json.loads(path.read_text())
        for key in case.drop_keys:
            config.pop(key, None)
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return ref


def engine_greedy(engine: Engine, prompt: list[int], n: int = GEN_LEN) -> list[int]:
    events = list(generate(engine, prompt, SamplingParams(max_tokens=n, temperature=0.0)))
    assert isinstance(events[-1], DoneEvent)
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def check_case(case: SweepCase, out_dir: Path, **build_kw: Any) -> CaseOutcome:
    """Build, load and compare one case; ``problems`` is empty when everything agrees."""
    ref = build_case(case, out_dir, **build_kw)
    engine = Engine.load(ref.out_dir, family=KernelFamily.F32)
    try:
        tf = teacher_forced_argmax(engine, ref.tf_ids)
        greedy = engine_greedy(engine, ref.prompt_ids, len(ref.greedy_ids))
    finally:
        engine.close()
    return CaseOutcome(case, ref, tf, greedy, compare(ref, tf, greedy))


def compare(ref: tiny_models.OracleReference, tf: list[int], greedy: list[int]) -> list[str]:
    """Every disagreement, each with the reference's top-1/top-2 logit gap where it happened."""
    problems = []
    start = len(ref.prompt_ids) - 1
    if ref.tf_pred[start:] != ref.greedy_ids[: len(ref.tf_pred) - start]:
        problems.append(f"reference itself: cached generate != full forward ({_first(ref)})")
    if tf != ref.tf_pred:
        i = _first_diff(tf, ref.tf_pred)
        gap = _gap(ref.tf_logits[i])
        problems.append(
            f"teacher-forced {_agree(tf, ref.tf_pred)}/{len(tf)}: first at position {i} "
            f"(engine {tf[i]}, transformers {ref.tf_pred[i]}, reference top-2 gap {gap:.3g})"
        )
    if greedy != ref.greedy_ids:
        i = _first_diff(greedy, ref.greedy_ids)
        gap = _gap(ref.greedy_logits[i]) if i < len(ref.greedy_ids) else float("nan")
        problems.append(
            f"greedy {_agree(greedy, ref.greedy_ids)}/{len(ref.greedy_ids)}: first at step {i} "
            f"(reference top-2 gap {gap:.3g})"
        )
    # greedy step i and teacher-forced position start + i see the same tokens while the engine's
    # continuation equals the reference's, i.e. up to and including its first divergence
    n = min(_first_diff(greedy, ref.greedy_ids) + 1, len(greedy), len(tf) - start)
    if tf[start : start + n] != greedy[:n]:
        problems.append("engine itself: incremental decode != its own prefill")
    return problems


def _first(ref: tiny_models.OracleReference) -> str:
    start = len(ref.prompt_ids) - 1
    i = _first_diff(ref.tf_pred[start:], ref.greedy_ids)
    return f"step {i}, top-2 gap {_gap(ref.greedy_logits[i]):.3g}"


def _first_diff(a: list[int], b: list[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def _agree(a: list[int], b: list[int]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=False))


def _gap(logits: np.ndarray) -> float:
    top = np.sort(np.asarray(logits, dtype=np.float64))[-2:]
    return float(top[1] - top[0])
