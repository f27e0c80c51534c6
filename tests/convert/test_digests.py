"""Digests: every writer records them in manifest.json, `colibri inspect --verify` holds a
container to them, and a container without them is still described (with a note)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from corrupt_helpers import edit, fill_f32, flip, tensors, zero
from interrupt_helpers import KILL_IN_SECOND_SHARD

from colibri_cli.main import main
from colibrid.convert.synth import synth

ROOT = Path(__file__).resolve().parents[2]
EXPERT = "model.layers.1.mlp.experts.2.up_proj.weight"
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A small synthetic container (one dense + two MoE layers, 4 experts), never edited."""
    return synth(tmp_path_factory.mktemp("tiny") / "c", "tiny", layers=3, experts=4)


@pytest.fixture
def copy(tiny: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny, tmp_path / "copy"))


def independent_digests(folder: Path) -> dict[str, dict]:
    """{shard: {"digest": ..., "tensors": {...}}} hashed here with xxhash directly."""
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        data = shard.read_bytes()
        out[shard.name] = {
            "digest": xxhash.xxh3_64(data).hexdigest(),
            "tensors": {
                n: xxhash.xxh3_64(data[b:e]).hexdigest() for n, (b, e) in tensors(shard).items()
            },
        }
    return out


def recorded(folder: Path) -> dict[str, dict]:
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["hash"] == "xxh3-64"
    return {s["name"]: {"digest": s["digest"], "tensors": s["tensors"]} for s in manifest["shards"]}


def test_synth_records_every_shard_and_tensor(tiny: Path) -> None:
    assert recorded(tiny) == independent_digests(tiny)


def test_convert_records_every_shard_and_tensor(source_checkpoint, tmp_path: Path) -> None:
    dst = tmp_path / "c"
    args = [str(source_checkpoint("f32").out_dir), str(dst), "--shard-gb", "0.0003", "--quiet"]
    assert main(["convert", *args]) == 0
    digests = recorded(dst)
    assert len(digests) >= 3
    assert digests == independent_digests(dst)


def test_a_resumed_older_conversion_hashes_its_finished_shards(
    source_checkpoint, tmp_path: Path
) -> None:
    """A conversion begun by a colibri that kept no digests in its progress file: the
    shards it finished are hashed from the files when this one completes it."""
    dst = tmp_path / "c"
    args = [str(source_checkpoint("f32").out_dir), str(dst), "--shard-gb", "0.0003", "--quiet"]
    proc = subprocess.run(
        [sys.executable, "-c", KILL_IN_SECOND_SHARD, "convert", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 137, proc.stderr
    progress = dst / ".colibri-convert.json"
    state = json.loads(progress.read_text())
    assert state.pop("digests")  # what an older colibri's progress file looks like
    progress.write_text(json.dumps(state))
    assert main(["convert", *args]) == 0
    assert recorded(dst) == independent_digests(dst)


def verify(capsys, folder: Path, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["inspect", str(folder), "--verify", *extra])
    return rc, capsys.readouterr().out


def test_verify_passes_a_whole_container(tiny: Path, capsys) -> None:
    rc, out = verify(capsys, tiny)
    assert rc == 0, out
    assert "every byte matches its digest" in out and "BAD" not in out


@pytest.mark.parametrize(
    ("name", "change"),
    [
        (EXPERT, flip(4096)),  # an expert matrix: 4 KB inverted (all of it, here)
        (EXPERT + ".qs", fill_f32(1e30)),  # its scales set to a finite 1e30
        (EMBED, zero(65536)),  # embeddings zeroed (all of them, here)
    ],
    ids=["expert-bytes", "expert-scales", "embeddings"],
)
def test_verify_names_the_shard_and_tensor(copy: Path, capsys, name: str, change) -> None:
    shard = next(copy.glob("*.safetensors"))
    edit(shard, name, change)
    rc, out = verify(capsys, copy)
    assert rc == 1, out
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert bad == [bad[0]] and f"{shard}: tensor '{name}': xxh3-64 " in bad[0], out


def test_every_scale_of_a_layer_is_named(copy: Path, capsys) -> None:
    shard = next(copy.glob("*.safetensors"))
    scales = [n for n in tensors(shard) if n.startswith("model.layers.2.mlp.experts.")]
    scales = [n for n in scales if n.endswith(".qs")]
    for name in scales:
        edit(shard, name, fill_f32(1e30))
    rc, out = verify(capsys, copy)
    assert rc == 1
    assert sorted(line.split("'")[1] for line in out.splitlines() if line.startswith("BAD")) == (
        sorted(scales)
    )


def test_header_padding_and_missing_or_extra_shards(copy: Path, capsys) -> None:
    shard = next(copy.glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    assert raw[8 + n - 1 : 8 + n] == b" ", "the converter pads its headers with spaces"
    raw[8 + n - 1] = ord("\t")  # still valid JSON, another file
    shard.write_bytes(bytes(raw))
    rc, out = verify(capsys, copy)
    assert rc == 1 and "header or padding bytes differ" in out, out
    shutil.copy(shard, copy / "out-00009.safetensors")
    shard.unlink()
    rc, out = verify(capsys, copy)
    assert rc == 1
    assert f"BAD {shard}: in the manifest, missing from the folder" in out
    assert "out-00009.safetensors: not in the manifest" in out


def test_a_container_without_digests_gets_a_note(copy: Path, capsys) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["hash"]
    for shard in manifest["shards"]:
        del shard["digest"], shard["tensors"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    edit(next(copy.glob("*.safetensors")), EMBED, zero(100))  # nothing can notice
    rc, out = verify(capsys, copy)
    assert rc == 0, out
    assert "records no digests" in out and "nothing to check against" in out
    assert "container " in out  # the description is still printed
    rc, _ = verify(capsys, copy, "--strict")
    assert rc == 1


def test_pull_links_a_container_and_notes_missing_digests(copy: Path, tmp_path: Path) -> None:
    env = {**os.environ, "COLIBRI_HOME": str(tmp_path / "home")}

    def pull(folder: Path, name: str) -> subprocess.CompletedProcess:
        # a synthetic container has no tokenizer.json: installed for token-id prompts
        cmd = [sys.executable, "-m", "colibri_cli", "pull", str(folder), "--name", name]
        cmd.append("--no-tokenizer")
        return subprocess.run(cmd, env=env, capture_output=True, text=True)

    whole = pull(copy, "whole")
    assert whole.returncode == 0 and "note" not in whole.stderr, whole.stderr
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["hash"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    bare = pull(copy, "bare")
    assert bare.returncode == 0, bare.stderr
    assert "records no digests" in bare.stderr and "load unchecked" in bare.stderr
