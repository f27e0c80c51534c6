"""Damaged weights never answer: through `colibri inspect --verify` and the real daemon.

The built-in demo is damaged three ways (4 KB inverted in every expert matrix, one layer's
expert scales set to a finite 1e30, 64 KB of the embeddings zeroed). Each is named, shard
and tensor, by `inspect --verify`; by the daemon with its experts resident (the load is
refused) and streamed (`cache = 2`: the embeddings refuse the load, a damaged expert fails
each request that reads it, is never cached, and once the file is repaired the same daemon
answers as a fresh one). A container without digests loads with a note. A model whose
logits turn NaN fails that request with a clear error; the next is answered as by a
fresh daemon.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from corrupt_helpers import copy_container, edit, fill_f32, flip, tensors, zero
from daemon_helpers import Home

from colibrid.convert.synth import synth

ASK = ("ask", "--temperature", "0", "--max-tokens", "8", "Write a short line about the sea")
STREAMED = dict(cache=2, shutdown_grace_s=2.0)
SHARD = "out-00000.safetensors"
SCALES_LAYER = 5


def experts_flipped(names: list[str]) -> list[str]:
    return [n for n in names if ".mlp.experts." in n and n.endswith("_proj.weight")]


def layer_scales(names: list[str]) -> list[str]:
    prefix = f"model.layers.{SCALES_LAYER}.mlp.experts."
    return [n for n in names if n.startswith(prefix) and n.endswith(".qs")]


def embeddings(names: list[str]) -> list[str]:
    return ["model.embed_tokens.weight"]


# case: (the tensors damaged, how, whether streaming still loads)
CASES: dict[str, tuple[Callable[[list[str]], list[str]], Callable, bool]] = {
    "expert-bytes": (experts_flipped, flip(4096), True),
    "expert-scales": (layer_scales, fill_f32(1e30), True),
    "embeddings": (embeddings, zero(65536), False),
}


@pytest.fixture(scope="module")
def fresh_answer(demo_container: Path, tmp_path_factory) -> str:
    home = Home(tmp_path_factory.mktemp("fresh"), demo_container, prompt_cache=False)
    home.start()
    try:
        result = home.colibri(*ASK)
        assert result.returncode == 0, result.stderr + home.log()
        return result.stdout
    finally:
        home.close()


@pytest.fixture(scope="module", params=list(CASES))
def damaged(request, demo_container: Path, tmp_path_factory) -> tuple[str, Path, list[str]]:
    pick, change, _ = CASES[request.param]
    folder = copy_container(demo_container, tmp_path_factory.mktemp(request.param) / "model")
    names = pick(list(tensors(folder / SHARD)))
    for name in names:
        edit(folder / SHARD, name, change)
    return request.param, folder, names


def named(text: str, folder: Path, names: list[str]) -> bool:
    """`text` names the shard and one of the damaged tensors."""
    found = re.findall(rf"{re.escape(str(folder / SHARD))}: tensor '([^']+)'", text)
    return bool(found) and all(n in names for n in found)


def test_inspect_verify_names_every_damaged_tensor(damaged, tmp_path: Path) -> None:
    case, folder, names = damaged
    home = Home(tmp_path / "home", folder)
    result = home.colibri("inspect", str(folder), "--verify", timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    bad = [line for line in result.stdout.splitlines() if line.startswith("BAD")]
    assert sorted(re.findall(r"tensor '([^']+)'", "\n".join(bad))) == sorted(names)
    assert all(line.startswith(f"BAD {folder / SHARD}: tensor ") for line in bad)


def test_resident_daemon_refuses_to_load(damaged, tmp_path: Path) -> None:
    case, folder, names = damaged
    home = Home(tmp_path / "home", folder)
    try:
        result = home.colibrid("start")
        assert result.returncode != 0, result.stdout + home.log()
        assert "bytes differ from the digest" in result.stderr, result.stderr
        assert named(result.stderr, folder, names), result.stderr
    finally:
        home.close()


def _repair(folder: Path, clean: Path, names: list[str]) -> None:
    """Write the clean bytes back in place (no truncation under the daemon's mapping)."""
    spans = tensors(clean / SHARD)
    with open(clean / SHARD, "rb") as src, open(folder / SHARD, "r+b") as dst:
        for name in names:
            begin, end = spans[name]
            os.pwrite(dst.fileno(), os.pread(src.fileno(), end - begin, begin), begin)
        os.fsync(dst.fileno())


def test_streamed_daemon_fails_each_request_then_answers_once_repaired(
    damaged, demo_container: Path, fresh_answer: str, tmp_path: Path
) -> None:
    case, folder, names = damaged
    loads = CASES[case][2]
    home = Home(tmp_path / "home", folder, **STREAMED)
    try:
        if not loads:  # the embeddings are mapped: checked at load, refused
            result = home.colibrid("start")
            assert result.returncode != 0 and named(result.stderr, folder, names), result.stderr
            return
        home.start()
        for _ in range(2):  # the second reads it again: the damaged bytes were not kept
            result = home.colibri(*ASK)
            assert result.returncode != 0, result.stdout
            assert "INTERNAL" in result.stderr and "read from disk" in result.stderr
            assert named(result.stderr, folder, names), result.stderr
        assert home.colibri("ps").returncode == 0  # the daemon lives
        _repair(folder, demo_container, names)
        result = home.colibri(*ASK)
        assert result.returncode == 0, result.stderr + home.log()
        assert result.stdout == fresh_answer
    finally:
        home.close()


def test_a_container_without_digests_loads_with_a_note(
    demo_container: Path, fresh_answer: str, tmp_path: Path
) -> None:
    folder = Path(shutil.copytree(demo_container, tmp_path / "model", copy_function=os.link))
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["hash"]
    for shard in manifest["shards"]:
        shard.pop("digest"), shard.pop("tensors")
    (folder / "manifest.json").unlink()  # a link to the demo's: replace, never write through
    (folder / "manifest.json").write_text(json.dumps(manifest))
    for settings in ({}, STREAMED):
        home = Home(tmp_path / f"home{len(settings)}", folder, **settings)
        home.start()
        try:
            result = home.colibri(*ASK)
            assert result.returncode == 0, result.stderr + home.log()
            assert result.stdout == fresh_answer
            assert "records no digests" in home.log() and "not checked" in home.log()
        finally:
            home.close()


# ---- NaN logits ------------------------------------------------------------------------


def _token_of(folder: Path, text: str) -> int:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    assert len(ids) == 1
    return ids[0]


def test_nan_logits_fail_the_request_and_the_next_is_right(tmp_path: Path) -> None:
    """One token's embedding row scaled past float32's range (checks off, so it loads):
    a prompt holding it turns to NaN; one without it is unaffected."""
    clean = synth(tmp_path / "clean", "glm4-tiny", layers=2, experts=4)
    folder = copy_container(clean, tmp_path / "nan")
    row = _token_of(folder, "~")

    def huge_row(b):  # int8 rows with one F32 scale each: that row's scale
        b.view("<f4")[row] = 3e38

    edit(folder / SHARD, "model.embed_tokens.weight.qs", huge_row)
    ask = ("ask", "--temperature", "0", "--max-tokens", "6")
    fresh = Home(tmp_path / "fresh", clean, prompt_cache=False)
    fresh.start()
    try:
        expected = fresh.colibri(*ask, "hello")
        assert expected.returncode == 0, expected.stderr
    finally:
        fresh.close()
    home = Home(tmp_path / "home", folder, verify_weights=False)
    home.start()
    try:
        failed = home.colibri(*ask, "hello ~ there")
        assert failed.returncode != 0, failed.stdout
        assert "INTERNAL" in failed.stderr and "non-finite logits" in failed.stderr
        again = home.colibri(*ask, "hello")
        assert again.returncode == 0, again.stderr + home.log()
        assert again.stdout == expected.stdout
    finally:
        home.close()
