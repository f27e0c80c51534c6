"""Config sweep oracle (issue 13): every architecture token-exact on drawn configs, not only on
the one tiny config of ``test_oracle.py``.

* ``test_sweep``: a fixed, seeded set of configs per architecture (``CI_CASES``, half as many
  for the softmax-routed Qwen3-MoE, Mixtral and OLMoE; ``sweep.py`` draws them across the
  valid space); teacher-forced argmax over prompt + continuation, greedy
  20/20, and decode == prefill, at f32.
* more drawn configs on demand: ``COLIBRI_SWEEP_COUNT=200 pytest -m sweep tests/oracle``
  (``COLIBRI_SWEEP_START`` moves the window; indices below 1000 are the CI set's).
* ``REGRESSIONS``: configs that failed once, pasted as printed by a failing case.
* Mixtral at sliding_window 1, where transformers' cached generate contradicts its own full
  forward: the engine follows the full forward.
* GLM-5 DSA: the issue's config, edge configs of the indexer, the tie rule of the reference, a
  context growing hundreds of tokens past ``index_topk`` during decode, and the indexer key cache
  through a forked prompt cache and a saved and restored session (``kv/``).
* DeepSeek-V3.2 DSA (the same indexer, rotate_half RoPE): edge configs of the indexer, the
  long decode and the indexer key cache as GLM-5's, and that most CI cases have contexts
  longer than ``index_topk``, so the indexer selects.
* quantised routed experts (int8, int4-g64) against the dequantised reference on swept configs.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import sweep
import tiny_models
import torch

from colibrid.backends.base import KernelFamily
from colibrid.engine import kv_files
from colibrid.engine.engine import Engine
from colibrid.engine.generate import TokenEvent, generate, teacher_forced_argmax
from colibrid.engine.sampling import SamplingParams
from colibrid.formats.quant import container_tensors, dequantize, quantize
from colibrid.formats.weights import WeightFormat

CI_CASES = 24
# The softmax-routed families have fewer moving parts (no groups, shared experts, MTP or
# DSA) and run half as many; COLIBRI_SWEEP_COUNT draws more of every architecture.
CI_CASES_OF = {
    arch: CI_CASES // 2 if arch in tiny_models.SOFTMAX_ARCHS else CI_CASES
    for arch in tiny_models.ARCHS
}
CI_PAIRS = [(arch, index) for arch in tiny_models.ARCHS for index in range(CI_CASES_OF[arch])]
EXTRA_CASES = int(os.environ.get("COLIBRI_SWEEP_COUNT", "0") or 0)
EXTRA_START = int(os.environ.get("COLIBRI_SWEEP_START", "1000") or 1000)

# A quantised case whose first disagreement sits where the reference's top-2 logits are closer
# than this is skipped with the gap in the reason (pytest -rs lists them), never silently.
QUANT_NEAR_TIE = 1e-4


def _assert_exact(outcome: sweep.CaseOutcome) -> None:
    assert not outcome.problems, outcome.report()


@pytest.mark.sweep
@pytest.mark.parametrize(("arch", "index"), CI_PAIRS, ids=[f"{a}-{i}" for a, i in CI_PAIRS])
def test_sweep(arch: str, index: int, tmp_path: Path) -> None:
    _assert_exact(sweep.check_case(sweep.draw_case(arch, index), tmp_path))


if EXTRA_CASES > 0:  # defined only on demand, so the default run shows no empty-set skips

    @pytest.mark.sweep
    @pytest.mark.parametrize("index", range(EXTRA_START, EXTRA_START + EXTRA_CASES))
    @pytest.mark.parametrize("arch", tiny_models.ARCHS)
    def test_sweep_extra(arch: str, index: int, tmp_path: Path) -> None:
        _assert_exact(sweep.check_case(sweep.draw_case(arch, index), tmp_path))


# Failing configs as a failing case prints them (SweepCase.to_json), one string each.
REGRESSIONS = [
    # glm_moe_dsa with "rope_interleave": false: transformers ignores the key (GLM-5 always
    # interleaves), the engine used to switch its MLA and indexer RoPE to rotate_half
    '{"arch": "glm_moe_dsa", "drop_keys": [], "overrides": {"attention_bias": false, '
    '"first_k_dense_replace": 1, "hidden_size": 32, "index_head_dim": 4, "index_n_heads": 2, '
    '"index_topk": 32, "indexer_types": ["full", "shared"], "intermediate_size": 96, '
    '"kv_lora_rank": 16, "max_position_embeddings": 256, "moe_intermediate_size": 16, '
    '"n_group": 1, "n_routed_experts": 6, "n_shared_experts": 2, "norm_topk_prob": true, '
    '"num_attention_heads": 1, "num_experts_per_tok": 2, "num_hidden_layers": 2, '
    '"num_key_value_heads": 1, "q_lora_rank": 96, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, '
    '"rms_norm_eps": 1e-05, "rope_interleave": false, "rope_parameters": {"rope_theta": 50000.0, '
    '"rope_type": "default"}, "routed_scaling_factor": 2.01, "tie_word_embeddings": false, '
    '"topk_group": 1, "v_head_dim": 32, "vocab_size": 160}, "prompt_len": 9, "seed": 1159}',
]


@pytest.mark.parametrize("text", REGRESSIONS, ids=lambda t: sweep.SweepCase.from_json(t).arch)
def test_regression(text: str, tmp_path: Path) -> None:
    _assert_exact(sweep.check_case(sweep.SweepCase.from_json(text), tmp_path))


# ----------------------------------------------------------------------------- Mixtral window

# sliding_window 1: every row sees only its own key. transformers' sliding cache keeps the last
# `window - 1` keys with a [-0:] slice, i.e. all of them, so its cached generate drifts from its
# own full forward after two tokens; the engine applies the mask of the full forward.
WINDOW_ONE = sweep.SweepCase(
    arch="mixtral",
    seed=7476,
    prompt_len=13,
    overrides=dict(
        head_dim=None,
        hidden_size=128,
        intermediate_size=16,
        num_attention_heads=4,
        num_experts_per_tok=1,
        num_hidden_layers=1,
        num_key_value_heads=2,
        num_local_experts=5,
        rms_norm_eps=1e-06,
        rope_parameters={"rope_theta": 50000.0, "rope_type": "default"},
        sliding_window=1,
        vocab_size=96,
    ),
)


def test_mixtral_window_of_one_follows_the_full_forward(tmp_path: Path) -> None:
    """Where transformers' cached generate contradicts its full forward (window 1), the
    engine equals the full forward and an uncached greedy, and decodes as it prefills."""
    outcome = sweep.check_case(WINDOW_ONE, tmp_path)
    assert [p.split(":")[0] for p in outcome.problems] == ["reference itself", "greedy 2/20"]
    assert outcome.tf == outcome.ref.tf_pred
    model = tiny_models.load_reference_model(outcome.ref.out_dir)
    ids = list(outcome.ref.prompt_ids)
    with torch.no_grad():
        for _ in outcome.greedy:
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
    assert outcome.greedy == ids[len(outcome.ref.prompt_ids) :]


# ----------------------------------------------------------------------------- GLM-5 DSA

# Issue 13 as filed: an 18-token prompt with index_topk 6 (selection from the first decode
# step), every indexer layer "full", two dense layers first, 3 index heads of 48 dims, 4 groups
# of which 2 compete. With torch's unspecified tie order it diverged at the third token.
ISSUE_13 = sweep.SweepCase(
    arch="glm_moe_dsa",
    seed=9,
    prompt_len=18,
    overrides=dict(
        num_hidden_layers=4,
        first_k_dense_replace=2,
        index_topk=6,
        indexer_types=["full"] * 4,
        index_n_heads=3,
        index_head_dim=48,
        n_group=4,
        topk_group=2,
    ),
)


def test_issue13_glm5_dsa_config_is_exact(tmp_path: Path) -> None:
    outcome = sweep.check_case(ISSUE_13, tmp_path)
    _assert_exact(outcome)
    diag = outcome.ref.diagnostics
    assert diag["dsa_rows_selecting"] > 0
    assert diag["dsa_tied_rows"] > 0  # the reason it diverged: exact ties at the top-k cut


def test_unpinned_reference_contradicts_itself_on_ties(tmp_path: Path) -> None:
    """Why the reference pins the DSA tie rule: with torch.topk's own order, transformers'
    cached generate and its full forward disagree on the issue's config (both unpinned)."""
    ref = sweep.build_case(ISSUE_13, tmp_path, pin_ties=False)
    start = len(ref.prompt_ids) - 1
    assert ref.tf_pred[start:] != ref.greedy_ids[: len(ref.tf_pred) - start]


def _glm5(**overrides) -> sweep.SweepCase:
    """The tiny GLM-5 config of test_oracle.py (12-token prompt), with overrides."""
    return sweep.SweepCase("glm_moe_dsa", tiny_models.DEFAULT_SEEDS["glm_moe_dsa"], 12, overrides)


def _v32(**overrides) -> sweep.SweepCase:
    """The tiny DeepSeek-V3.2 config of test_oracle.py (12-token prompt), with overrides."""
    return sweep.SweepCase("deepseek_v32", tiny_models.DEFAULT_SEEDS["deepseek_v32"], 12, overrides)


DSA_EDGES = {
    "oracle-config": _glm5(),
    "topk-1": _glm5(index_topk=1),
    "topk-prompt": _glm5(index_topk=12),
    "topk-prompt-minus-1": _glm5(index_topk=11),
    "one-index-head": _glm5(index_n_heads=1),
    "shared-after-first": _glm5(num_hidden_layers=4, indexer_types=["full"] + ["shared"] * 3),
    "index-head-dim-is-rope": _glm5(index_head_dim=16),
    "v32-oracle-config": _v32(),
    "v32-topk-1": _v32(index_topk=1),
    "v32-topk-prompt-minus-1": _v32(index_topk=11),
    "v32-one-index-head": _v32(index_n_heads=1),
    "v32-index-head-dim-is-rope": _v32(index_head_dim=16),
    "v32-four-layers": _v32(num_hidden_layers=4, first_k_dense_replace=2, index_topk=6),
}


@pytest.mark.parametrize("name", sorted(DSA_EDGES))
def test_dsa_edge_config(name: str, tmp_path: Path) -> None:
    _assert_exact(sweep.check_case(DSA_EDGES[name], tmp_path))


@pytest.mark.parametrize("arch", tiny_models.DSA_ARCHS)
def test_dsa_ci_cases_mostly_select(arch: str) -> None:
    """The drawn top-k is below the teacher-forced context in most CI cases, so the sweep
    checks the indexer's selection, not only dense attention."""
    cases = [sweep.draw_case(arch, index) for index in range(CI_CASES_OF[arch])]
    selecting = [c for c in cases if c.overrides["index_topk"] < c.prompt_len + sweep.GEN_LEN - 1]
    assert len(selecting) >= 3 * len(cases) // 4


LONG_PROMPT = 16
LONG_GEN = 320
LONG_SPLIT = 160


@pytest.fixture(scope="module", params=tiny_models.DSA_ARCHS)
def long_dsa(request, tmp_path_factory) -> tiny_models.OracleReference:
    """GLM-5 / DeepSeek-V3.2 with index_topk 8 under a 16-token prompt and 320 greedy tokens:
    the context grows ~330 tokens past index_topk during decode."""
    arch = request.param
    case = sweep.SweepCase(
        arch,
        tiny_models.DEFAULT_SEEDS[arch],
        LONG_PROMPT,
        dict(index_topk=8, max_position_embeddings=512),
    )
    return sweep.build_case(case, tmp_path_factory.mktemp(f"long-{arch}"), gen_len=LONG_GEN)


def _continue(engine: Engine, ids: list[int], n: int, session) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0.0)
    events = generate(engine, ids, params, session=session)
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def test_long_context_dsa_decode_matches(long_dsa: tiny_models.OracleReference) -> None:
    ref = long_dsa
    engine = Engine.load(ref.out_dir, family=KernelFamily.F32)
    try:
        greedy = sweep.engine_greedy(engine, ref.prompt_ids, LONG_GEN)
        tf = teacher_forced_argmax(engine, ref.tf_ids)
    finally:
        engine.close()
    assert not sweep.compare(ref, tf, greedy), sweep.compare(ref, tf, greedy)


def test_long_context_dsa_restored_kv_continues(
    long_dsa: tiny_models.OracleReference, tmp_path: Path
) -> None:
    """The indexer key cache travels with the prompt cache (fork) and the saved KV (kv/)."""
    ref = long_dsa
    first = ref.prompt_ids + ref.greedy_ids[:LONG_SPLIT]
    engine = Engine.load(ref.out_dir, family=KernelFamily.F32)
    try:
        session = engine.new_session()
        assert _continue(engine, ref.prompt_ids, LONG_SPLIT, session) == ref.greedy_ids[:LONG_SPLIT]
        forked = session.fork(len(first) - 1)
        assert _continue(engine, first, 40, forked) == ref.greedy_ids[LONG_SPLIT : LONG_SPLIT + 40]
        assert kv_files.save([session], tmp_path / "kv", engine) == 1
        saved = {
            key: session.cache.read(*key, session.length).copy() for key in _index_keys(engine)
        }
    finally:
        engine.close()
    engine = Engine.load(ref.out_dir, family=KernelFamily.F32)
    try:
        (restored,) = kv_files.load(tmp_path / "kv", engine)
        for key in _index_keys(engine):
            np.testing.assert_array_equal(restored.cache.read(*key, restored.length), saved[key])
        rest = _continue(engine, first, LONG_GEN - LONG_SPLIT, restored)
        assert rest == ref.greedy_ids[LONG_SPLIT:]
    finally:
        engine.close()


def _index_keys(engine: Engine) -> list[tuple[int, str]]:
    keys = [
        (layer, "index_k")
        for layer, layout in enumerate(engine.model.cache_layouts())
        if "index_k" in layout
    ]
    assert keys, "no DSA indexer key cache"
    return keys


# ----------------------------------------------------------------------------- quantised

QUANT_FORMATS = {"int8": (WeightFormat.Q8, 0), "int4-g64": (WeightFormat.Q4, 64)}
QUANT_PAIRS = [(arch, index) for arch, index in CI_PAIRS if index % 2 == 0]


@pytest.mark.sweep
@pytest.mark.parametrize("fmt", sorted(QUANT_FORMATS))
@pytest.mark.parametrize(("arch", "index"), QUANT_PAIRS, ids=[f"{a}-{i}" for a, i in QUANT_PAIRS])
def test_sweep_quantised_experts(arch: str, index: int, fmt: str, tmp_path: Path) -> None:
    weight_format, group_size = QUANT_FORMATS[fmt]

    def roundtrip(name: str, w: np.ndarray) -> np.ndarray:
        return dequantize(quantize(w, weight_format, group_size))

    def as_container(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
        return container_tensors(name, quantize(w, weight_format, group_size))

    case = sweep.draw_case(arch, index)
    outcome = sweep.check_case(
        case, tmp_path, expert_transform=roundtrip, expert_container=as_container
    )
    if outcome.problems and outcome.first_gap() < QUANT_NEAR_TIE:
        pytest.skip(f"near tie, reference top-2 logit gap {outcome.first_gap():.2e}: {case}")
    _assert_exact(outcome)
