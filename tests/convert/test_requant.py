"""`colibri requant --by-heat` and `colibri eval` (issue 41) on a tiny GLM-4.5 checkpoint.

* the heat rule ranks a layer's experts by profile count (ties to the lower index) and
  cuts hot / middle / cold shares of the experts;
* requant writes each expert in the planned format (hot int8, middle int4-g64 as stored,
  cold int2-affine), quantised once from --source's f32, copies everything else byte for
  byte, leaves MODEL untouched, and records the plan id the loader computes;
* an interrupted requant resumes to the same bytes; other options into the same folder
  are refused;
* eval is zero against itself, positive against the source for a lossy plan, reads fewer
  expert bytes a token with cold experts at 2 bits, and gives the same figures twice.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from daemon_helpers import install_chat_tokenizer

from colibri_cli.main import main
from colibrid.convert.heat import HeatOptions, plan_by_heat
from colibrid.engine.engine import Engine
from colibrid.engine.layout import expert_layout
from colibrid.formats import quant
from colibrid.formats.weights import WeightFormat
from colibrid.models import family
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.precision_plan import stored_label
from colibrid.store.usage import usage_text

ARCH = "glm4_moe"
OPTS = ["--hot-share", "0.25", "--hot-bits", "8", "--cold-share", "0.5", "--cold-bits", "2"]


def test_heat_rule_ranks_by_count_ties_to_lower_index() -> None:
    counts = np.array([[0, 0, 0, 0], [5, 9, 9, 1]])
    plan = plan_by_heat(counts, [1], 4, HeatOptions(0.25, 8, 0.5, 2, 4))
    # ranking 1 (9), 2 (9, the tie goes to the lower index first), 0 (5), 3 (1)
    assert [plan.bits[1, e] for e in range(4)] == [2, 8, 4, 2]
    assert plan.cold_traffic == pytest.approx(6 / 24) and plan.hot_traffic == pytest.approx(9 / 24)
    with pytest.raises(Exception, match="exceed 1"):
        HeatOptions(0.6, 8, 0.6, 2, 4).check()


@pytest.fixture(scope="module")
def tiny(oracle_checkpoint, tmp_path_factory):
    """(f32 source with a tokenizer, its int4 container, a skewed profile)."""
    root = tmp_path_factory.mktemp("requant")
    src = root / "src"
    shutil.copytree(oracle_checkpoint(ARCH).out_dir, src)
    install_chat_tokenizer(src)
    model = root / "int4"
    assert main(["convert", str(src), str(model), "--quiet"]) == 0
    config = json.loads((model / "config.json").read_text())
    n_layers, n_experts = config["num_hidden_layers"], config["n_routed_experts"]
    counts = np.zeros((n_layers, n_experts), dtype=np.int64)
    for layer in range(n_layers):
        for e in range(n_experts):
            counts[layer, (3 * e + layer) % n_experts] = 7 * (n_experts - e) + 1
    profile = root / "heat.coli_usage"
    profile.write_bytes(usage_text(counts, ARCH))
    return src, model, profile, counts


def _digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def test_requant_writes_the_plan_and_copies_the_rest(tiny, tmp_path) -> None:
    src, model, profile, counts = tiny
    before = _digests(model)
    dst = tmp_path / "mixed"
    args = ["requant", str(model), "--by-heat", str(profile), *OPTS, "--source", str(src)]
    assert main([*args, "-o", str(dst), "--quiet"]) == 0
    assert _digests(model) == before  # MODEL is never changed: it is the undo
    ckpt, out, source = Checkpoint.open(model), Checkpoint.open(dst), Checkpoint.open(src)
    try:
        args_ = family(ARCH).ModelArgs.from_config(ckpt.config)
        layout = expert_layout(args_, ckpt)
        plan = plan_by_heat(
            counts, layout.profiled_layers, layout.n_experts, HeatOptions(0.25, 8, 0.5, 2, 4)
        )
        want = {8: "int8-row", 4: "int4", 2: "int2-affine-g64"}
        assert {plan.count(b) for b in (8, 4, 2)} and plan.count(2) > 0 and plan.count(8) > 0
        expert_names = set()
        for (layer, e), bits in plan.bits.items():
            name = layout.tensor_name(layer, e, "gate_proj")
            shape = layout.shape("gate_proj")
            assert stored_label(out, name, shape).startswith(want[bits]), (layer, e, bits)
            if bits != 4:  # quantised once, from the source's f32
                fmt = WeightFormat.Q8 if bits == 8 else WeightFormat.Q2
                expect = quant.dequantize(quant.quantize(source.array(name), fmt, 64))
                np.testing.assert_array_equal(quant.dequantize(out.weight(name, shape)), expect)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                n = layout.tensor_name(layer, e, proj)
                expert_names |= {n, n + ".qs"}
        for name in ckpt.names():
            if name not in expert_names:
                assert bytes(out.raw(name)) == bytes(ckpt.raw(name)), name
        recorded = json.loads((dst / "manifest.json").read_text())["precision_plan"]
    finally:
        for c in (ckpt, out, source):
            c.close()
    loaded = {}
    for path in (model, dst):
        engine = Engine.load(path)
        loaded[path] = engine.info.plan
        engine.close()
    assert recorded["id"] == loaded[dst].id and not loaded[dst].uniform
    assert loaded[model].uniform and loaded[model].id != loaded[dst].id


def test_requant_resumes_to_the_same_bytes_and_refuses_other_options(tiny, tmp_path) -> None:
    _, model, profile, _ = tiny
    dst = tmp_path / "mixed"
    args = ["requant", str(model), "--by-heat", str(profile), *OPTS, "-o", str(dst), "--quiet"]
    assert main(args) == 0
    whole = _digests(dst)
    # An interrupted run: the shard and manifest never landed, the progress says so.
    progress = json.loads((dst / ".colibri-convert.json").read_text())
    for shard in list(progress["shards"]):
        (dst / shard).unlink()
    progress.update(shards={}, digests={}, complete=False)
    (dst / ".colibri-convert.json").write_text(json.dumps(progress))
    (dst / "manifest.json").unlink()
    assert main(args) == 0
    assert _digests(dst) == whole
    other = [a if a != "2" else "3" for a in args]  # cold bits 3: another plan
    assert main(other) == 1


def test_inspect_shows_each_expert_format_with_its_count_and_size(tiny, tmp_path, capsys) -> None:
    """A plan's container: one line per expert kind (formats, stored size, how many), the
    largest as the slot size, the per-token figure from the mean expert."""
    from colibrid.convert.inspect import inspect

    src, model, profile, counts = tiny
    dst = tmp_path / "mixed"
    args = ["requant", str(model), "--by-heat", str(profile), *OPTS, "--source", str(src)]
    assert main([*args, "-o", str(dst), "--quiet"]) == 0
    uniform, mixed = inspect(model), inspect(dst)
    assert len(uniform.expert_kinds) == 1 and uniform.expert_bytes_per_token == (
        uniform.top_k * uniform.expert_bytes * uniform.moe_layers
    )
    with Checkpoint.open(model) as ckpt:
        layout = expert_layout(family(ARCH).ModelArgs.from_config(ckpt.config), ckpt)
    plan = plan_by_heat(
        counts, layout.profiled_layers, layout.n_experts, HeatOptions(0.25, 8, 0.5, 2, 4)
    )
    by_bits = {int(f.split("-")[0][3:]): (n, size) for (f, size), n in mixed.expert_kinds.items()}
    assert {b: n for b, (n, _) in by_bits.items()} == {b: plan.count(b) for b in (8, 4, 2)}
    sizes = {b: size for b, (_, size) in by_bits.items()}
    assert sizes[8] > sizes[4] > sizes[2] and sizes[4] == uniform.expert_bytes
    assert mixed.expert_bytes == sizes[8]  # a streaming slot holds the largest
    assert mixed.expert_bytes_per_token < mixed.top_k * sizes[8] * mixed.moe_layers
    capsys.readouterr()
    assert main(["inspect", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "expert sizes   3 kinds" in out, out
    for b, (n, size) in by_bits.items():
        assert f"{n:>6} x {size / 1e6:8.2f} MB  " in out, (b, out)


def test_eval_zero_against_itself_lossy_against_source_deterministic(
    tiny, tmp_path, capsys
) -> None:
    src, model, profile, _ = tiny
    dst = tmp_path / "mixed"
    requant = ["requant", str(model), "--by-heat", str(profile), *OPTS, "--source", str(src)]
    assert main([*requant, "-o", str(dst), "--quiet"]) == 0
    capsys.readouterr()

    def evaluate(what: Path, ref: Path) -> dict:
        flags = ["--prompts", "1", "--tokens", "8", "--json", "--quiet"]
        assert main(["eval", str(what), "--against", str(ref), *flags]) == 0
        return json.loads(capsys.readouterr().out)

    same = evaluate(model, model)
    assert same["kl_mean"] == 0.0 and same["top1_agreement"] == 1.0
    assert same["ppl_model"] == same["ppl_ref"] and same["positions"] == 4 * 8
    mixed, uniform = evaluate(dst, src), evaluate(model, src)
    assert mixed["kl_mean"] > 0 and uniform["kl_mean"] > 0
    assert mixed["plan"]["id"] != uniform["plan"]["id"]
    assert 0 < mixed["expert_bytes_per_token"] < uniform["expert_bytes_per_token"]
    assert evaluate(dst, src) == mixed  # deterministic, figure for figure
