"""`colibri convert`: round trips against transformers, exact bytes, layout, resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from interrupt_helpers import KILL_IN_SECOND_SHARD
from quant_reference import EXACT_FLAGS, ref_quant
from safetensors import safe_open

from colibri_cli.main import main
from colibrid.backends.base import KernelFamily
from colibrid.convert.convert import convert
from colibrid.convert.plan import ConvertParams
from colibrid.engine.engine import Engine
from colibrid.engine.generate import DoneEvent, TokenEvent, generate, teacher_forced_argmax
from colibrid.engine.sampling import SamplingParams
from colibrid.errors import CheckpointError
from colibrid.formats.weights import WeightFormat
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.safetensors_file import SafetensorsFile

ROOT = Path(__file__).resolve().parents[2]


def greedy(engine: Engine, prompt: list[int], n: int = 20) -> list[int]:
    events = list(generate(engine, prompt, SamplingParams(max_tokens=n, temperature=0.0)))
    assert isinstance(events[-1], DoneEvent)
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def all_tensors(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as fh:  # the safetensors library reads it
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


@pytest.mark.parametrize("dtype", ["f32", "bf16", "fp8", "nvfp4"])
def test_round_trip_matches_transformers(converted, dtype: str) -> None:
    ref, dst = converted(dtype)
    engine = Engine.load(dst, family=KernelFamily.F32)
    try:
        layer = engine.experts.layout.moe_layers[0]
        assert engine.experts.get(layer, 0).gate.fmt == WeightFormat.Q4
        assert engine.experts.get(layer, 0).gate.group_size == 64
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
        if dtype == "f32":
            assert teacher_forced_argmax(engine, ref.tf_ids) == ref.tf_pred
    finally:
        engine.close()


def test_bytes_equal_independent_numpy(source_checkpoint, tmp_path: Path) -> None:
    """Default classes: experts int4-g64, io int8, attention int4-g64, MTP int8, plus a
    per-row int4 run: every quantised tensor equals the spec implemented from scratch."""
    ref = source_checkpoint("f32")
    src = {}
    for f in ref.out_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="np") as fh:
            src.update({k: fh.get_tensor(k) for k in fh.keys()})
    for gs in (64, 0):
        dst = tmp_path / f"g{gs}"
        assert (
            main(["convert", str(ref.out_dir), str(dst), "--group-size", str(gs), "--quiet"]) == 0
        )
        out = all_tensors(dst)
        checked = {8: 0, 4: 0}
        for name, w in src.items():
            if name + ".qs" not in out:
                assert out[name].dtype == np.float32 and np.array_equal(out[name], w), name
                continue
            bits = 8 if out[name].shape[1] == w.shape[1] and w.shape[1] > 1 else 4
            data, scales = ref_quant(w, bits, gs)
            assert np.array_equal(out[name], data), name
            assert np.array_equal(out[name + ".qs"].reshape(scales.shape), scales), name
            checked[bits] += 1
        assert checked[8] >= 3 and checked[4] >= 50
        emb = "model.embed_tokens.weight"
        assert out[emb].shape == src[emb].shape  # io class is int8 by default


def test_file_is_valid_and_experts_adjacent(converted) -> None:
    _, dst = converted("f32")
    shard = dst / "out-00000.safetensors"
    with safe_open(str(shard), framework="np") as fh:
        meta = fh.metadata()
        assert meta["colibri.group_size"] == "64"
        assert meta["colibri.converter"].startswith("colibri-convert")
    f = SafetensorsFile.open(shard)
    try:
        p = "model.layers.1.mlp.experts.5."
        names = [p + f"{m}_proj.weight" for m in ("down", "gate", "up")]
        names += [n + ".qs" for n in names]
        spans = [(f.tensors[n].file_begin, f.tensors[n].file_end) for n in names]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    finally:
        f.close()
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest["converter"].startswith("colibri-convert")
    assert json.loads((dst / ".colibri-convert.json").read_text())["complete"] is True
    assert (dst / "generation_config.json").is_file()
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())


def test_interrupted_then_resumed_is_byte_identical(source_checkpoint, tmp_path: Path) -> None:
    ref = source_checkpoint("f32")
    args = [str(ref.out_dir), "--shard-gb", "0.0003", "--quiet"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main(["convert", args[0], str(whole), *args[1:]]) == 0
    proc = subprocess.run(
        [sys.executable, "-c", KILL_IN_SECOND_SHARD, "convert", args[0], str(resumed), *args[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 137, proc.stderr
    assert list(resumed.glob(".*.partial")), "expected a partial shard left by the kill"
    assert not (resumed / "manifest.json").exists()
    with pytest.raises(CheckpointError, match="incomplete conversion"):
        Checkpoint.open(resumed)
    assert main(["convert", args[0], str(resumed), *args[1:]]) == 0
    files = sorted(p.name for p in whole.iterdir())
    assert files == sorted(p.name for p in resumed.iterdir())
    assert len([n for n in files if n.endswith(".safetensors")]) >= 3
    for name in files:
        assert (whole / name).read_bytes() == (resumed / name).read_bytes(), name
    # a third run is a no-op; other parameters in the same DST are refused
    assert main(["convert", args[0], str(resumed), *args[1:]]) == 0


def test_mixed_parameters_refused(source_checkpoint, tmp_path: Path, capsys) -> None:
    ref = source_checkpoint("f32")
    dst = tmp_path / "c"
    assert main(["convert", str(ref.out_dir), str(dst), *EXACT_FLAGS]) == 0
    capsys.readouterr()
    assert main(["convert", str(ref.out_dir), str(dst), "--bits", "8", "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert "refusing to mix parameter sets" in err and err.count("\n") == 0


def test_int4_mtp_needs_force(source_checkpoint, tmp_path: Path, capsys) -> None:
    ref = source_checkpoint("f32")
    assert main(["convert", str(ref.out_dir), str(tmp_path / "a"), "--mtp-bits", "4"]) == 1
    err = capsys.readouterr().err.strip()
    assert "acceptance" in err and "--force" in err and err.count("\n") == 0
    assert not (tmp_path / "a").exists()
    assert (
        main(
            [
                "convert",
                str(ref.out_dir),
                str(tmp_path / "b"),
                "--mtp-bits",
                "4",
                "--force",
                "--quiet",
            ]
        )
        == 0
    )


def test_order_profile_sets_expert_layout(source_checkpoint, tmp_path: Path) -> None:
    ref = source_checkpoint("f32")
    profile = tmp_path / "cooc.json"
    counts = [0] * 16
    counts[9], counts[3], counts[12] = 100, 90, 80
    profile.write_text(
        json.dumps(
            {
                "format": "colibri-cooccurrence",
                "version": 1,
                "layers": {"1": {"counts": counts, "pairs": [[9, 12, 50], [12, 3, 40], [9, 3, 5]]}},
            }
        )
    )
    dst = tmp_path / "c"
    r = convert(
        ref.out_dir,
        dst,
        ConvertParams(io_bits=32, attn_bits=32, dense_bits=32, shared_bits=32),
        order=profile,
    )
    assert r.shards >= 1
    with Checkpoint.open(dst) as ck:

        def start(layer: int, e: int) -> int:
            return ck.info(f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight").file_begin

        layer1 = sorted(range(16), key=lambda e: start(1, e))
        assert layer1[:3] == [9, 12, 3]
        assert layer1[3:] == [0, 1, 2, 4, 5, 6, 7, 8, 10, 11, 13, 14, 15]
        assert sorted(range(16), key=lambda e: start(2, e)) == list(range(16))
    engine = Engine.load(dst)
    try:
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids  # placement changes no token
    finally:
        engine.close()


def test_progress_bar_only_on_a_tty(source_checkpoint, tmp_path: Path, capsys) -> None:
    ref = source_checkpoint("f32")
    assert main(["convert", str(ref.out_dir), str(tmp_path / "c")]) == 0
    out, err = capsys.readouterr()
    assert "MB/s" in out and err == ""


def test_order_reads_the_stores_usage_and_cooccurrence(tmp_path: Path) -> None:
    """`--order` takes what the tiered store writes: `.coli_usage` plus its co-occurrence
    sidecar, so experts that fire together end up next to each other."""
    from colibrid.convert.order import ExpertOrderProfile
    from colibrid.store.usage import UsageProfile

    usage = UsageProfile(2, 8, "glm4_moe", (1,))
    for _ in range(5):
        usage.record(1, [2, 6])  # 2 and 6 always fire together
        usage.end_forward()
    usage.record(1, [0, 2])
    usage.end_forward()
    path = tmp_path / ".coli_usage"
    usage.save(path)
    assert (tmp_path / ".coli_usage.cooc.npz").is_file()
    order = ExpertOrderProfile.load(path).order(1, list(range(8)))
    assert order[:2] == [2, 6]


def test_status_reports_resident_experts_at_their_stored_size(converted) -> None:
    """`colibri ps` counts an int4-g64 expert at its int4 bytes, not as f32."""
    from colibrid.engine.engine import Engine

    _, dst = converted("f32")
    engine = Engine.load(dst)
    try:
        store = engine.experts
        one = store.get(store.layers[0], 0)
        assert one.gate.fmt.value == "q4"
        stored = store.statistics().expert_bytes  # what STATUS multiplies the tiers by
        assert stored == one.nbytes
        layout = store.layout
        assert stored < 3 * layout.hidden * layout.ffn  # under a byte per weight
    finally:
        engine.close()
