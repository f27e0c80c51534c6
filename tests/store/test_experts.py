"""ResidentExpertStore: validated at construction, views out, usage counted."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from colibrid.errors import ModelLoadError
from colibrid.formats import quant
from colibrid.formats.weights import WeightFormat
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.experts import ExpertLayout, ExpertWeights
from colibrid.store.protocol import ExpertStore
from colibrid.store.resident import ResidentExpertStore

HIDDEN, FFN, N_EXPERTS = 8, 6, 4
NUM_HIDDEN_LAYERS = 3  # layers 0..2; the MTP layer is index 3


def expert_tensors(layer, n_experts=N_EXPERTS, *, prefix="model.layers", q8=False, drop=None):
    rng = np.random.default_rng(layer)
    out = {}
    for e in range(n_experts):
        for proj, shape in (
            ("gate_proj", (FFN, HIDDEN)),
            ("up_proj", (FFN, HIDDEN)),
            ("down_proj", (HIDDEN, FFN)),
        ):
            name = f"{prefix}.{layer}.mlp.experts.{e}.{proj}.weight"
            if name == drop:
                continue
            w = rng.standard_normal(shape).astype(np.float32)
            if q8:
                out.update(quant.container_tensors(name, quant.quantize(w, WeightFormat.Q8)))
            else:
                out[name] = w
    return out


def make_ckpt(tmp_path, tensors) -> Checkpoint:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": NUM_HIDDEN_LAYERS}))
    save_file(tensors, str(d / "out-00001.safetensors"))
    return Checkpoint.open(d)


def layout(layers=(1, 2), **kw) -> ExpertLayout:
    return ExpertLayout(moe_layers=layers, n_experts=N_EXPERTS, hidden=HIDDEN, ffn=FFN, **kw)


def test_get_returns_checked_views(tmp_path):
    tensors = {**expert_tensors(1), **expert_tensors(2, q8=True)}
    with make_ckpt(tmp_path, tensors) as ck:
        store = ResidentExpertStore(ck, layout())
        assert isinstance(store, ExpertStore)  # structural check of the protocol
        assert store.layers == (1, 2)
        ew = store.get(1, 3)
        assert isinstance(ew, ExpertWeights)
        assert ew.gate.shape == (FFN, HIDDEN) and ew.up.shape == (FFN, HIDDEN)
        assert ew.down.shape == (HIDDEN, FFN)
        assert np.array_equal(
            ew.down.data, tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
        )
        assert not ew.gate.data.flags.owndata  # a view of the mapping, not a copy
        assert store.get(1, 3) is ew  # nothing rebuilt per call
        q = store.get(2, 0)
        assert q.up.fmt is WeightFormat.Q8 and q.up.scales.shape == (FFN,)
        assert ew.nbytes == 3 * FFN * HIDDEN * 4
        many = store.get_many(2, [3, 1, 3])
        assert [m is store.get(2, e) for m, e in zip(many, [3, 1, 3], strict=True)] == [True] * 3
        with pytest.raises(KeyError):
            store.get(0, 0)
        with pytest.raises(KeyError):
            store.get(1, N_EXPERTS)


def test_record_counts_selections(tmp_path):
    with make_ckpt(tmp_path, {**expert_tensors(1), **expert_tensors(2)}) as ck:
        store = ResidentExpertStore(ck, layout())
        assert store.counts.shape == (3, N_EXPERTS) and store.counts.dtype == np.int64
        store.record(1, [0, 2])
        store.record(1, np.array([2, 2]))
        store.record(2, [])
        assert store.counts[1].tolist() == [1, 0, 3, 0]
        assert not store.counts[[0, 2]].any()
        with pytest.raises(KeyError):
            store.record(1, [N_EXPERTS])
        with pytest.raises(KeyError):
            store.record(0, [0])


def test_missing_or_misshaped_expert_is_a_model_load_error(tmp_path):
    missing = "model.layers.2.mlp.experts.1.up_proj.weight"
    with make_ckpt(tmp_path, {**expert_tensors(1), **expert_tensors(2, drop=missing)}) as ck:
        with pytest.raises(ModelLoadError, match=missing.replace(".", r"\.")):
            ResidentExpertStore(ck, layout())
    with make_ckpt(tmp_path, expert_tensors(1)) as ck:
        bad = ExpertLayout(moe_layers=(1,), n_experts=N_EXPERTS, hidden=FFN, ffn=HIDDEN)
        with pytest.raises(ModelLoadError, match="expected"):
            ResidentExpertStore(ck, bad)


def test_mtp_layer_uses_the_same_template(tmp_path):
    # transformers writes the MTP layer as model.layers.{num_hidden_layers}...
    with make_ckpt(tmp_path, {**expert_tensors(1), **expert_tensors(NUM_HIDDEN_LAYERS)}) as ck:
        store = ResidentExpertStore(ck, layout((1, NUM_HIDDEN_LAYERS)))
        assert store.get(NUM_HIDDEN_LAYERS, 2).gate.shape == (FFN, HIDDEN)
        assert store.counts.shape == (NUM_HIDDEN_LAYERS + 1, N_EXPERTS)


def test_extra_layers_with_their_own_template(tmp_path):
    tensors = {**expert_tensors(1), **expert_tensors(7, prefix="mtp.layers")}
    with make_ckpt(tmp_path, tensors) as ck:
        tmpl = "mtp.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
        store = ResidentExpertStore(ck, layout((1,)), extra_layers={7: tmpl})
        assert store.layers == (1, 7)
        assert np.array_equal(
            store.get(7, 0).gate.data, tensors["mtp.layers.7.mlp.experts.0.gate_proj.weight"]
        )
        with pytest.raises(ValueError):
            ResidentExpertStore(ck, layout((1,)), extra_layers={1: tmpl})
        with pytest.raises(ValueError):
            ResidentExpertStore(ck, layout((1,)), extra_layers={7: "mtp.{layer}.{expert}"})


def test_layout_validation():
    with pytest.raises(ValueError):
        ExpertLayout(moe_layers=(1, 1), n_experts=2, hidden=2, ffn=2)
    with pytest.raises(ValueError):
        ExpertLayout(moe_layers=(1,), n_experts=0, hidden=2, ffn=2)
    with pytest.raises(ValueError):
        ExpertLayout(moe_layers=(1,), n_experts=2, hidden=2, ffn=2, name_template="{layer}.{x}")
    lay = ExpertLayout(moe_layers=(3,), n_experts=2, hidden=5, ffn=7)
    assert lay.shape("gate_proj") == (7, 5) and lay.shape("down_proj") == (5, 7)
    assert lay.tensor_name(3, 1, "up_proj") == "model.layers.3.mlp.experts.1.up_proj.weight"


def test_layout_names_projections_as_the_checkpoint_does():
    """Mixtral stores gate, up and down as w1, w3 and w2 under block_sparse_moe."""
    lay = ExpertLayout(
        moe_layers=(0,),
        n_experts=2,
        hidden=5,
        ffn=7,
        name_template="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
        proj_names=("w1", "w3", "w2"),
    )
    assert lay.tensor_name(0, 1, "up_proj") == "model.layers.0.block_sparse_moe.experts.1.w3.weight"
    assert lay.tensor_name(0, 0, "down_proj").endswith("experts.0.w2.weight")
    with pytest.raises(ValueError, match="proj_names"):
        ExpertLayout(moe_layers=(0,), n_experts=2, hidden=5, ffn=7, proj_names=("a", "a", "b"))
