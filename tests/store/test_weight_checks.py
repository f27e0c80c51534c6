"""The daemon's rule for weight digests (colibrid/store/weight_checks.py), in process: what
is mapped is checked at load, a streamed expert at its first read; a mismatch names the
shard and the tensor, fails only what needed those bytes, and is never cached."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from corrupt_helpers import edit, fill_f32, flip, tensors, zero

from colibrid.convert.synth import synth
from colibrid.engine.engine import Engine
from colibrid.engine.generate import TokenEvent, generate
from colibrid.engine.sampling import SamplingParams
from colibrid.errors import CorruptWeights
from colibrid.store.options import StoreOptions
from colibrid.store.tiered import TieredStore

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7]
STREAMED = StoreOptions(mode="tiered", cache=1, pilot="off", pin="off", io_threads=2)
RESIDENT = StoreOptions(mode="resident")
MOE_LAYER = 2  # every expert of it is damaged, so any routing needs a damaged one
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    return synth(tmp_path_factory.mktemp("tiny") / "c", "tiny", layers=3, experts=4)


@pytest.fixture(scope="module")
def answer(clean: Path) -> list[int]:
    return tokens(clean, RESIDENT)


@pytest.fixture
def copy(clean: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(clean, tmp_path / "copy"))


def shard(folder: Path) -> Path:
    return next(folder.glob("*.safetensors"))


def layer_experts(folder: Path, suffix: str) -> list[str]:
    prefix = f"model.layers.{MOE_LAYER}.mlp.experts."
    return [n for n in tensors(shard(folder)) if n.startswith(prefix) and n.endswith(suffix)]


def damage_experts(folder: Path) -> None:
    for name in layer_experts(folder, "proj.weight"):
        edit(shard(folder), name, flip(4096))


def damage_scales(folder: Path) -> None:
    for name in layer_experts(folder, ".qs"):
        edit(shard(folder), name, fill_f32(1e30))


def generate_with(engine: Engine, n: int = 6) -> list[int]:
    events = generate(engine, PROMPT, SamplingParams(max_tokens=n))
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def tokens(folder: Path, opts: StoreOptions) -> list[int]:
    engine = Engine.load(folder, store=opts)
    try:
        return generate_with(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("opts", [RESIDENT, STREAMED], ids=["resident", "streamed"])
def test_damaged_embeddings_refuse_the_load(copy: Path, opts: StoreOptions) -> None:
    edit(shard(copy), EMBED, zero(65536))
    with pytest.raises(CorruptWeights, match=f"{shard(copy)}: tensor '{EMBED}': bytes differ"):
        Engine.load(copy, store=opts)


@pytest.mark.parametrize("damage", [damage_experts, damage_scales], ids=["bytes", "scales"])
def test_damaged_resident_experts_refuse_the_load(copy: Path, damage) -> None:
    damage(copy)
    pattern = rf"{shard(copy)}: tensor 'model\.layers\.{MOE_LAYER}\.mlp\.experts\.\d\.\w+"
    with pytest.raises(CorruptWeights, match=pattern):
        Engine.load(copy, store=RESIDENT)


@pytest.mark.parametrize(
    ("damage", "suffix"), [(damage_experts, ".weight'"), (damage_scales, ".weight.qs'")]
)
def test_a_damaged_streamed_expert_fails_the_request_and_is_not_kept(
    copy: Path, clean: Path, answer: list[int], damage, suffix: str
) -> None:
    damage(copy)
    engine = Engine.load(copy, store=STREAMED)  # the dense part is whole: it loads
    try:
        store = engine.experts
        assert isinstance(store, TieredStore)
        for _ in range(2):  # a second request reads it again: nothing kept the bad bytes
            with pytest.raises(CorruptWeights) as info:
                generate_with(engine)
            message = str(info.value)
            assert message.startswith(f"{shard(copy)}: tensor 'model.layers.{MOE_LAYER}.")
            assert suffix in message and f"of layer {MOE_LAYER}, read from disk)" in message
            assert info.value.code == "INTERNAL"
            store.check_consistency()
            assert not store.placement.cache[MOE_LAYER], "a damaged expert was cached"
        shutil.copy(shard(clean), shard(copy))  # the file repaired: the same store answers
        assert generate_with(engine) == answer
    finally:
        engine.close()


def test_an_expert_is_checked_on_its_first_read_only(clean: Path) -> None:
    engine = Engine.load(clean, store=STREAMED)
    try:
        checks = engine.experts.reader.checks
        assert checks is not None and checks.for_read((MOE_LAYER, 0)) is not None
        engine.experts.get(MOE_LAYER, 0)
        assert checks.for_read((MOE_LAYER, 0)) is None  # passed once: later reads are not
        assert checks.for_read((MOE_LAYER, 1)) is not None
        stats = engine.experts.statistics()
        assert stats.checked == 1 and "1 experts checked against their digests" in stats.lines()[1]
    finally:
        engine.close()


def test_verify_off_loads_damaged_weights(copy: Path, answer: list[int]) -> None:
    """What the checks prevent: the damage loads and changes the answer, no error."""
    damage_experts(copy)
    off = StoreOptions(mode="resident", verify=False)
    assert tokens(copy, off) != answer


def test_without_digests_a_container_loads_with_a_note(
    copy: Path, answer: list[int], caplog
) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["hash"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    caplog.set_level(logging.INFO, logger="colibri.store")
    for opts in (RESIDENT, STREAMED):
        assert tokens(copy, opts) == answer
    notes = [r.message for r in caplog.records if "note:" in r.message]
    assert notes and "records no digests" in notes[0] and "not checked" in notes[0]


def test_a_streamed_expert_without_a_digest_refuses_the_load(copy: Path) -> None:
    """Checked from the headers at load, not discovered at a first read mid-request."""
    manifest = json.loads((copy / "manifest.json").read_text())
    name = layer_experts(copy, "down_proj.weight")[0]
    del manifest["shards"][0]["tensors"][name]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptWeights, match=f"tensor '{name}' is not in the manifest's digests"):
        Engine.load(copy, store=STREAMED)
