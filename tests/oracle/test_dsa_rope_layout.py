"""DeepSeek-V3.2 and GLM-5 run one DSA indexer (layers/dsa.py) that differs in one place: the
RoPE layout of the index queries and keys, rotate_half on V3.2 and interleaved pairs on GLM-5
(the MLA interleaves in both). Tested both ways on the same weights: a V3.2 checkpoint
relabelled GLM-5 and an all-"full" GLM-5 checkpoint relabelled V3.2.

* transformers: the two classes give the same logits wherever the indexer keeps every key
  (the first ``index_topk`` positions), and different ones after, so the layout is the only
  difference and it matters;
* the engine follows the label: on each folder it predicts what transformers' class of that
  label predicts, so on the relabelled weights it leaves the original reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tiny_models as tm
import torch

from colibrid.backends.base import KernelFamily
from colibrid.engine.engine import Engine


def _all_full(oracle_checkpoint, arch: str) -> tm.OracleReference:
    """The tiny checkpoint of ``arch`` with an indexer on every layer, so that either label
    finds the weights it needs (the GLM-5 fixture has a "shared" layer without them)."""
    if arch == "glm_moe_dsa":
        n = tm.tiny_config(arch).num_hidden_layers
        return oracle_checkpoint(arch, config_overrides={"indexer_types": ["full"] * n})
    return oracle_checkpoint(arch)


def _relabel(ref: tm.OracleReference, arch: str, dst: Path) -> Path:
    """``ref``'s weights (linked, not copied) under a config.json naming ``arch``: every
    other key is kept, so only the family, hence the indexer's RoPE layout, changes."""
    dst.mkdir()
    for f in ref.out_dir.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((ref.out_dir / "config.json").read_text())
    config["model_type"] = arch
    config["architectures"] = [tm._CLASSES[arch][1]]
    config.pop("indexer_types", None)
    if arch == "glm_moe_dsa":
        config["indexer_types"] = ["full"] * config["num_hidden_layers"]
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dst


def _reference_logits(folder: Path, ids: list[int]) -> np.ndarray:
    """transformers' teacher-forced logits of the class named by ``folder``'s config, with
    the DSA tie rule pinned as the oracle pins it."""
    model = tm.load_reference_model(folder)
    assert tm.pin_dsa_ties(model)
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


def _engine_logits(folder: Path, ids: list[int]) -> tuple[np.ndarray, bool]:
    """The engine's logits at every position of ``ids`` (one prefill) and whether its
    indexer interleaves."""
    engine = Engine.load(folder, family=KernelFamily.F32)
    try:
        interleave = engine.args.indexer.interleave
        return np.asarray(engine.new_session().prefill(ids, all_logits=True)), interleave
    finally:
        engine.close()


@pytest.mark.parametrize("arch", tm.DSA_ARCHS)
def test_indexer_rope_layout_matters_both_ways(oracle_checkpoint, tmp_path: Path, arch: str):
    ref = _all_full(oracle_checkpoint, arch)
    other = next(a for a in tm.DSA_ARCHS if a != arch)
    folder = _relabel(ref, other, tmp_path / other)
    k = tm.tiny_config(arch).index_topk
    assert k < len(ref.tf_ids)

    own = _reference_logits(ref.out_dir, ref.tf_ids)
    theirs = _reference_logits(folder, ref.tf_ids)
    assert own.argmax(-1).tolist() == ref.tf_pred
    np.testing.assert_allclose(theirs[:k], own[:k], atol=1e-5, rtol=0)  # every key kept
    assert np.abs(theirs[k:] - own[k:]).max() > 1e-2  # the layout changes what is kept
    assert theirs.argmax(-1).tolist() != ref.tf_pred

    engine_own, own_interleave = _engine_logits(ref.out_dir, ref.tf_ids)
    engine_other, other_interleave = _engine_logits(folder, ref.tf_ids)
    assert own_interleave == (arch == "glm_moe_dsa") and other_interleave != own_interleave
    assert engine_own.argmax(-1).tolist() == ref.tf_pred
    assert engine_other.argmax(-1).tolist() == theirs.argmax(-1).tolist()
    np.testing.assert_allclose(engine_other[:k], engine_own[:k], atol=1e-5, rtol=0)
    assert np.abs(engine_other[k:] - engine_own[k:]).max() > 1e-2
