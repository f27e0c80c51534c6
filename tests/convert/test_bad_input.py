"""Bad sources and hostile environments: one clear line each, DST never looks complete."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from colibri_cli.main import main
from colibrid.errors import CheckpointError
from colibrid.store.checkpoint import Checkpoint

ROOT = Path(__file__).resolve().parents[2]


def run_convert(capsys, src: Path, dst: Path, *extra: str) -> str:
    """Run a failing conversion; return its one error line."""
    capsys.readouterr()
    assert main(["convert", str(src), str(dst), "--quiet", *extra]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("colibri convert: error: ") and "\n" not in err, err
    return err


def assert_not_complete(dst: Path) -> None:
    assert not (dst / "manifest.json").exists()
    assert not list(dst.glob(".*.partial")) if dst.exists() else True
    if dst.exists() and any(dst.glob("*.safetensors")):
        with pytest.raises(CheckpointError, match="incomplete"):
            Checkpoint.open(dst)


@pytest.fixture()
def f32_copy(source_checkpoint, tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(source_checkpoint("f32").out_dir, src)
    return src


def _raw_file(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_truncated_shard(f32_copy: Path, tmp_path: Path, capsys) -> None:
    shard = f32_copy / "model-00001-of-00002.safetensors"
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 1000)
    err = run_convert(capsys, f32_copy, tmp_path / "dst")
    assert "model-00001-of-00002.safetensors" in err
    assert_not_complete(tmp_path / "dst")


def test_header_lies_about_sizes(f32_copy: Path, tmp_path: Path, capsys) -> None:
    _raw_file(
        f32_copy / "extra.safetensors",
        {"model.extra.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}},
        bytes(32),
    )
    index = f32_copy / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.extra.weight"] = "extra.safetensors"
    index.write_text(json.dumps(doc))
    err = run_convert(capsys, f32_copy, tmp_path / "dst")
    assert "model.extra.weight" in err
    assert_not_complete(tmp_path / "dst")


def test_unknown_dtype(f32_copy: Path, tmp_path: Path, capsys) -> None:
    _raw_file(
        f32_copy / "extra.safetensors",
        {"model.extra.ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}},
        bytes(16),
    )
    (f32_copy / "model.safetensors.index.json").unlink()  # glob all *.safetensors
    err = run_convert(capsys, f32_copy, tmp_path / "dst")
    assert "model.extra.ids" in err and "I64" in err
    assert_not_complete(tmp_path / "dst")


def test_missing_config(f32_copy: Path, tmp_path: Path, capsys) -> None:
    (f32_copy / "config.json").unlink()
    err = run_convert(capsys, f32_copy, tmp_path / "dst")
    assert "config.json" in err
    assert not (tmp_path / "dst").exists()


def test_nvfp4_reciprocal_global_refused(source_checkpoint, tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    shutil.copytree(source_checkpoint("nvfp4").out_dir, src)
    shard = src / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    name = "model.layers.1.mlp.experts.0.up_proj.weight_scale_2"
    tensors[name] = torch.tensor(448.0 * 6.0)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    err = run_convert(capsys, src, tmp_path / "dst")
    assert name in err and "compressed-tensors" in err
    assert_not_complete(tmp_path / "dst")


def test_not_enough_free_disk(source_checkpoint, tmp_path: Path, capsys, monkeypatch) -> None:
    import colibrid.convert.convert as conv

    monkeypatch.setattr(
        conv.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 30, 10 << 30, 1 << 20)
    )
    err = run_convert(capsys, source_checkpoint("f32").out_dir, tmp_path / "dst")
    assert "not enough free disk" in err and "out-00000.safetensors" in err
    assert_not_complete(tmp_path / "dst")


_FSIZE = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # write() fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
from colibri_cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_full_disk_during_write(source_checkpoint, tmp_path: Path) -> None:
    """A write that fails mid-shard (a file-size limit stands in for a full disk)."""
    dst = tmp_path / "dst"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _FSIZE,
            "convert",
            str(source_checkpoint("f32").out_dir),
            str(dst),
            "--quiet",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    err = proc.stderr.strip()
    assert proc.returncode == 1, err
    assert err.startswith("colibri convert: error: writing ") and "\n" not in err, err
    assert "File too large" in err
    assert_not_complete(dst)
    assert not list(dst.glob(".*.partial"))


def test_dst_not_a_conversion(source_checkpoint, tmp_path: Path, capsys) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    err = run_convert(capsys, source_checkpoint("f32").out_dir, dst)
    assert "not empty" in err
    assert (dst / "notes.txt").read_text() == "mine"


def test_nonfinite_source(f32_copy: Path, tmp_path: Path, capsys) -> None:
    shard = f32_copy / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    name = "model.layers.1.mlp.experts.3.gate_proj.weight"
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    err = run_convert(capsys, f32_copy, tmp_path / "dst")
    assert name in err and "non-finite" in err
    assert_not_complete(tmp_path / "dst")
    assert np.isnan(load_file(str(shard))[name][0, 0].item())
