"""`colibri inspect` and load-time validation, on our containers and upstream-style ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from colibri_cli.main import main
from colibrid.convert.inspect import inspect
from colibrid.engine.engine import Engine
from colibrid.engine.validate import validate
from colibrid.errors import CheckpointError
from colibrid.store.checkpoint import Checkpoint


def test_inspect_output(converted, capsys) -> None:
    _, dst = converted("f32")
    capsys.readouterr()
    assert main(["inspect", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "glm_moe_dsa: 3 layers (1 dense + 2 MoE) + 1 MTP" in out
    assert "expert       int4-g64 x96" in out  # 2 MoE layers x 16 experts x 3
    assert "io           f32 x2" in out and "mtp          int8-row" in out
    r = inspect(dst)
    # expert: gate/up [64, 128] -> 64*64 B + 64*2 scales; down [128, 64] -> 128*32 + 128*1
    assert r.expert_bytes == 2 * (64 * 64 + 64 * 2 * 4) + 128 * 32 + 128 * 4
    assert r.expert_contiguous
    assert r.expert_bytes_per_token == 4 * r.expert_bytes * 2
    assert r.total_bytes == sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    assert r.resident_bytes + r.routed_bytes <= r.total_bytes


def _resave_like_upstream(src: Path, dst: Path) -> None:
    """The same tensors written by the safetensors library (its own order, no colibri
    metadata) under upstream's file names: what a mirror of an upstream container holds."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        with safe_open(str(f), framework="np") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        f.unlink()
        save_file(tensors, str(f))
    for p in (dst / ".colibri-convert.json", dst / "manifest.json"):
        p.unlink()


def test_upstream_style_container_loads_unchanged(converted, tmp_path: Path) -> None:
    ref, dst = converted("f32")
    up = tmp_path / "upstream"
    _resave_like_upstream(dst, up)
    r = inspect(up)
    # without the group-size hint a one-group-per-row down_proj [128, 64] reads as int4-row:
    # the same bytes and arithmetic
    assert r.formats["expert"] == {"int4-g64": 64, "int4-row": 32}
    engine = Engine.load(up)
    try:
        from test_convert import greedy

        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()


def _edit(folder: Path, fn) -> None:  # type: ignore[no-untyped-def]
    f = folder / "out-00000.safetensors"
    with safe_open(str(f), framework="np") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        meta = fh.metadata()
    fn(tensors)
    f.unlink()
    save_file(tensors, str(f), metadata=meta)


@pytest.mark.parametrize(
    "case,expect",
    [
        ("drop_qs", "without its .qs scales"),
        ("bad_shape", "model.layers.0.self_attn.o_proj.weight"),
        ("bad_scales", "match no format"),
        ("missing", "is missing"),
    ],
)
def test_validation_names_the_tensor(
    converted, tmp_path: Path, capsys, case: str, expect: str
) -> None:
    _, dst = converted("f32")
    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    expert = "model.layers.1.mlp.experts.2.up_proj.weight"
    if case == "drop_qs":
        _edit(bad, lambda t: t.pop(expert + ".qs"))
    elif case == "bad_shape":
        name = "model.layers.0.self_attn.o_proj.weight"
        _edit(bad, lambda t: t.__setitem__(name, np.zeros((3, 5), np.float32)))
    elif case == "bad_scales":
        _edit(bad, lambda t: t.__setitem__(expert + ".qs", np.zeros((64, 3), np.float32)))
    else:
        _edit(bad, lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    with Checkpoint.open(bad) as ck, pytest.raises(CheckpointError) as info:
        validate(ck)
    msg = str(info.value)
    assert expect in msg and "\n" not in msg
    capsys.readouterr()
    assert main(["inspect", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("colibri inspect: error:") and "\n" not in err


def test_incomplete_marker_is_refused(converted, tmp_path: Path) -> None:
    _, dst = converted("f32")
    bad = tmp_path / "c"
    shutil.copytree(dst, bad)
    state = json.loads((bad / ".colibri-convert.json").read_text())
    state["complete"] = False
    (bad / ".colibri-convert.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="incomplete conversion"):
        Engine.load(bad)
