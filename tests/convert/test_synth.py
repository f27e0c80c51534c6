"""`colibri synth`: deterministic, valid, runnable synthetic containers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri_cli.main import main
from colibrid.backends.base import KernelFamily
from colibrid.convert.inspect import inspect
from colibrid.convert.plan import ConvertParams, pack_shards
from colibrid.convert.synth import synth_config, synth_groups
from colibrid.engine.engine import Engine
from colibrid.engine.validate import expected_from_config

ROOT = Path(__file__).resolve().parents[2]


def planned_bytes(shape: str, layers: int, experts: int) -> tuple[int, int]:
    """(container bytes, one expert's bytes) from the plan alone, nothing written."""
    params = ConvertParams()
    groups = synth_groups(shape, synth_config(shape, layers, experts), params)
    expert = next(g for g in groups if len(g.items) == 3)
    return sum(s.nbytes for s in pack_shards(groups, params)), expert.nbytes


def test_glm5_sizes_are_the_real_ones() -> None:
    total, expert = planned_bytes("glm5", 4, 32)
    assert abs(expert - 21.23e6) < 0.01e6  # upstream: 21.23 MB int4-g64 GLM-5 expert
    assert 2.6e9 < total < 2.8e9  # the "~2.7 GB"
    cfg = synth_config("glm5", 4, 32)
    assert (
        cfg["hidden_size"],
        cfg["moe_intermediate_size"],
        cfg["num_experts_per_tok"],
        cfg["kv_lora_rank"],
        cfg["q_lora_rank"],
        cfg["index_topk"],
    ) == (6144, 2048, 8, 512, 2048, 2048)


def test_glm4_air_shape_plans() -> None:
    total, expert = planned_bytes("glm4-air", 2, 4)
    # gate/up [1408, 4096]: 1408*2048 B + 1408*64 scales; down [4096, 1408]: 4096*704 + 4096*22
    assert expert == 2 * (1408 * 2048 + 1408 * 64 * 4) + 4096 * 704 + 4096 * 22 * 4
    assert total > expert * 4


def test_qwen3_235b_shape_plans_its_real_expert() -> None:
    total, expert = planned_bytes("qwen3-235b", 2, 8)
    # gate/up [1536, 4096]: 1536*2048 B + 1536*64 scales; down [4096, 1536]: 4096*768 + 4096*24
    assert expert == 2 * (1536 * 2048 + 1536 * 64 * 4) + 4096 * 768 + 4096 * 24 * 4
    assert abs(expert - 10.62e6) < 0.01e6
    cfg = synth_config("qwen3-235b", 2, 8)
    assert (cfg["model_type"], cfg["num_experts"], cfg["num_key_value_heads"]) == (
        "qwen3_moe",
        8,
        4,
    )
    assert total > expert * 16
    # softmax routing has no selection bias: a stray one made every token pick the same
    # experts, so nothing streamed at 3x the budget
    _, expected = expected_from_config(cfg, lambda n: True)
    assert not [name for name in expected if "e_score_correction_bias" in name]
    _, glm5 = expected_from_config(synth_config("glm5", 4, 8), lambda n: True)
    assert [name for name in glm5 if "e_score_correction_bias" in name]


def test_deepseek_v32_shape_plans_its_real_expert() -> None:
    total, expert = planned_bytes("deepseek-v32", 4, 32)
    # gate/up [2048, 7168]: 2048*3584 B + 2048*112 scales; down [7168, 2048]: 7168*1024 + 7168*32
    assert expert == 2 * (2048 * 3584 + 2048 * 112 * 4) + 7168 * 1024 + 7168 * 32 * 4
    assert abs(expert - 24.77e6) < 0.01e6
    assert total > expert * 3 * 32
    cfg = synth_config("deepseek-v32", 4, 32, mtp=True)
    assert (cfg["model_type"], cfg["n_group"], cfg["topk_group"], cfg["index_n_heads"]) == (
        "deepseek_v32",
        8,
        4,
        64,
    )
    args, expected = expected_from_config(cfg, lambda n: True)
    assert not args.indexer.interleave and args.attention.interleave
    assert "model.layers.4.self_attn.indexer.wq_b.weight" in expected  # the MTP layer's
    # fewer experts than the real groups need: routed without groups
    assert synth_config("deepseek-v32", 2, 4)["n_group"] == 1


def test_gpt_oss_120b_shape_plans_its_real_expert() -> None:
    total, expert = planned_bytes("gpt-oss-120b", 2, 8)
    # gate/up/down [2880, 2880] in MXFP4 as the real checkpoint ships them (FP4):
    # 2880*1440 B of codes + 2880*90 e8m0 scale bytes each
    assert expert == 3 * (2880 * 1440 + 2880 * 90)
    assert abs(expert - 13.22e6) < 0.01e6
    cfg = synth_config("gpt-oss-120b", 2, 8)
    assert (cfg["model_type"], cfg["num_local_experts"], cfg["num_key_value_heads"]) == (
        "gpt_oss",
        8,
        8,
    )
    assert (cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"]) == (2880, 64, 64)
    assert total > expert * 16


def test_gpt_oss_synth_keeps_its_experts_in_fp4(tmp_path: Path) -> None:
    """gpt-oss-120b's synthetic experts are FP4, as a converted gpt-oss holds them: the
    container says so and decodes in both kernel families."""
    dst = tmp_path / "oss"
    args = ["synth", "--shape", "gpt-oss-120b", "--layers", "2", "--experts", "4"]
    assert main([*args, "--quiet", str(dst)]) == 0
    assert inspect(dst).formats["expert"] == {"fp4-e2m1-g32": 2 * 4 * 3}
    for family in (KernelFamily.F32, KernelFamily.I8):
        engine = Engine.load(dst, family=family)
        try:
            from colibrid.engine.generate import TokenEvent, generate
            from colibrid.engine.sampling import SamplingParams

            events = generate(engine, [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))
            assert len([e for e in events if isinstance(e, TokenEvent)]) == 3
        finally:
            engine.close()


def test_tiny_synth_is_deterministic_valid_and_runs(tmp_path: Path, capsys) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        assert (
            main(["synth", "--shape", "tiny", "--layers", "3", "--experts", "4", "--quiet", str(d)])
            == 0
        )
    files = sorted(p.name for p in a.iterdir())
    assert {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "manifest.json",
        "generation_config.json",
    } <= set(files)
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    report = inspect(a)
    assert (report.n_layers, report.moe_layers, report.n_experts) == (3, 2, 4)
    assert report.expert_contiguous and report.formats["expert"] == {"int4-g64": 24}
    engine = Engine.load(a)
    try:
        from colibrid.engine.generate import TokenEvent, generate
        from colibrid.engine.sampling import SamplingParams

        events = generate(engine, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
        assert len([e for e in events if isinstance(e, TokenEvent)]) == 4
    finally:
        engine.close()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibrid",
            "generate",
            "--model",
            str(a),
            "--prompt",
            "hi",
            "--max-tokens",
            "3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_bad_shape_is_one_line(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["synth", "--shape", "nope", str(tmp_path / "x")])
    assert main(["synth", "--shape", "tiny", "--layers", "0", str(tmp_path / "y")]) == 1
    assert "--layers" in capsys.readouterr().err


def hottest_quarter_share(model: Path, tmp: Path) -> float:
    """The share of a profile's selections the hottest quarter of each layer's experts
    carried, over a sampled run (`colibrid generate --profile`)."""
    from colibrid.store.usage import parse_counts

    profile = tmp / f"{model.name}.coli_usage"
    proc = subprocess.run(
        [sys.executable, "-m", "colibrid", "generate", "--model", str(model)]
        + ["--ids", "5,9,13,17", "--ids-out", "--max-tokens", "48", "--temperature", "1"]
        + ["--seed", "3", "--speculate", "off", "--profile", str(profile)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    report = inspect(model)
    shape = (report.n_layers, report.n_experts)
    counts = parse_counts(profile.read_text(), profile, shape)[-report.moe_layers :]
    ranked = -np.sort(-counts, axis=1)
    quarter = report.n_experts // 4
    return float(ranked[:, :quarter].sum() / ranked.sum())


def test_heat_skew_makes_some_experts_hot_and_others_cold(tmp_path: Path, capsys) -> None:
    """--heat-skew spreads the routers' selection biases: the same container otherwise, a
    run's selections pile onto fewer experts; the flat container's bias stays zero."""
    flat, skewed = tmp_path / "flat", tmp_path / "skewed"
    args = ["synth", "--shape", "tiny", "--layers", "2", "--experts", "16", "--quiet"]
    assert main([*args, str(flat)]) == 0
    assert main([*args, "--heat-skew", "2", str(skewed)]) == 0
    assert hottest_quarter_share(skewed, tmp_path) > hottest_quarter_share(flat, tmp_path) + 0.15
    assert main([*args, "--heat-skew", "-1", str(tmp_path / "bad")]) == 1
    assert "--heat-skew" in capsys.readouterr().err
    no_bias = ["synth", "--shape", "gpt-oss-120b", "--heat-skew", "1", str(tmp_path / "g")]
    assert main(no_bias) == 1
    assert "no selection bias" in capsys.readouterr().err
