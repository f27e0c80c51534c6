"""Checkpoint: directory discovery, typed weights per format, clear refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as save_np
from safetensors.torch import save_file as save_pt

from colibrid.errors import CheckpointError, ConfigError
from colibrid.formats import quant
from colibrid.formats.weights import WeightFormat
from colibrid.store.checkpoint import Checkpoint

CONFIG = {"model_type": "tiny", "hidden_size": 8}


def model_dir(tmp_path, files: dict[str, dict], *, config=CONFIG, index=None, metadata=None):
    """A model directory: {file name: {tensor: numpy array or torch tensor}}."""
    d = tmp_path / "model"
    d.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for fname, tensors in files.items():
        meta = (metadata or {}).get(fname)
        if tensors and all(isinstance(t, np.ndarray) for t in tensors.values()):
            save_np(tensors, str(d / fname), metadata=meta)
        else:
            tt = {
                k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                for k, v in tensors.items()
            }
            save_pt(tt, str(d / fname), metadata=meta)
    if index is not None:
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return d


def rand(*shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def container(name, w, fmt, gs=64):
    return quant.container_tensors(name, quant.quantize(w, fmt, group_size=gs))


# ---- discovery --------------------------------------------------------------------


def test_missing_directory_and_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="model directory not found"):
        Checkpoint.open(tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        Checkpoint.open(tmp_path / "f")


def test_missing_or_bad_config(tmp_path):
    d = model_dir(tmp_path, {"model.safetensors": {"a": rand(2)}}, config=None)
    with pytest.raises(ConfigError, match="config.json not found"):
        Checkpoint.open(d)
    for text, frag in [
        ("{bad", "invalid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"a": 1, "a": 2}', "duplicate key"),
    ]:
        (d / "config.json").write_text(text)
        with pytest.raises(ConfigError, match=frag) as info:
            Checkpoint.open(d)
        assert "config.json" in str(info.value) and "\n" not in str(info.value)


def test_no_weight_files(tmp_path):
    d = model_dir(tmp_path, {})
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        Checkpoint.open(d)


def test_single_file_lookup(tmp_path):
    d = model_dir(tmp_path, {"model.safetensors": {"a.weight": rand(3, 4), "n": rand(4)}})
    with Checkpoint.open(d) as ck:
        assert ck.config == CONFIG
        assert ck.names() == ["a.weight", "n"]
        assert ck.has("n") and not ck.has("x")
        assert ck.info("a.weight").shape == (3, 4)
        assert ck.file_of("n") == d / "model.safetensors"
        with pytest.raises(CheckpointError, match="'x' not found"):
            ck.info("x")


def test_upstream_container_shards_are_all_found(tmp_path):
    files = {
        "out-00001.safetensors": {"a": rand(2)},
        "out-00002.safetensors": {"b": rand(2)},
        "out-mtp-00001.safetensors": {"c": rand(2)},
        "out-idx-00001.safetensors": {"d": rand(2)},
    }
    d = model_dir(tmp_path, files)
    (d / "notes.txt").write_text("ignored")
    with Checkpoint.open(d) as ck:
        assert ck.names() == ["a", "b", "c", "d"]
        assert ck.file_of("c").name == "out-mtp-00001.safetensors"


def test_tensor_in_two_files_is_an_error(tmp_path):
    d = model_dir(
        tmp_path,
        {
            "model-00001-of-00002.safetensors": {"a": rand(2)},
            "model-00002-of-00002.safetensors": {"a": rand(2)},
        },
    )
    with pytest.raises(CheckpointError, match="'a' is defined in both"):
        Checkpoint.open(d)


def test_index_json(tmp_path):
    files = {
        "model-00001-of-00002.safetensors": {"a": rand(2)},
        "model-00002-of-00002.safetensors": {"b": rand(2)},
        "stray.safetensors": {"z": rand(2)},
    }
    index = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    d = model_dir(tmp_path, files, index=index)
    with Checkpoint.open(d) as ck:
        assert ck.names() == ["a", "b"]  # the index defines the file set
        assert ck.file_of("b").name == "model-00002-of-00002.safetensors"


@pytest.mark.parametrize(
    ("target", "fragment"),
    [
        ("../outside.safetensors", "outside the model directory"),
        ("sub/../../outside.safetensors", "outside the model directory"),
        ("/etc/passwd", "outside the model directory"),
        ("missing.safetensors", "does not exist"),
        ("", "bad file name"),
        ("x" * 5000 + ".safetensors", "does not exist"),
        (7, "bad file name"),
    ],
)
def test_index_pointing_outside_or_nowhere(tmp_path, target, fragment):
    save_np({"a": rand(2)}, str(tmp_path / "outside.safetensors"))
    d = model_dir(tmp_path, {"model.safetensors": {"a": rand(2)}}, index={"a": target})
    with pytest.raises(CheckpointError, match=fragment):
        Checkpoint.open(d)


def test_index_claims_wrong_file_or_is_malformed(tmp_path):
    d = model_dir(
        tmp_path,
        {"m1.safetensors": {"a": rand(2)}, "m2.safetensors": {"b": rand(2)}},
        index={"a": "m2.safetensors", "b": "m2.safetensors"},
    )
    with pytest.raises(CheckpointError, match="not in m2.safetensors as claimed"):
        Checkpoint.open(d)
    (d / "model.safetensors.index.json").write_text('{"weight_map": []}')
    with pytest.raises(CheckpointError, match="weight_map"):
        Checkpoint.open(d)


# ---- plain float weights ----------------------------------------------------------


def test_f32_bf16_f16_weights(tmp_path):
    w = torch.randn(3, 5)
    d = model_dir(
        tmp_path,
        {
            "model.safetensors": {
                "f32": w,
                "bf16": w.bfloat16(),
                "f16": w.half(),
                "i32": torch.zeros(3, 5, dtype=torch.int32),
            }
        },
    )
    with Checkpoint.open(d) as ck:
        f = ck.weight("f32", (3, 5))
        assert f.fmt is WeightFormat.F32 and np.array_equal(f.data, w.numpy())
        assert not f.data.flags.owndata and not f.data.flags.writeable  # zero-copy view
        b = ck.weight("bf16", (3, 5))
        assert b.fmt is WeightFormat.BF16 and b.data.dtype == np.uint16
        assert np.array_equal(ck.dense_f32("bf16", (3, 5)), w.bfloat16().float().numpy())
        h = ck.weight("f16", (3, 5))
        assert h.fmt is WeightFormat.F32 and np.array_equal(h.data, w.half().float().numpy())
        with pytest.raises(CheckpointError, match=r"shape \[3, 5\] but expected \[5, 3\]"):
            ck.weight("f32", (5, 3))
        with pytest.raises(CheckpointError, match="dtype I32 is not supported"):
            ck.weight("i32", (3, 5))
        with pytest.raises(ConfigError):
            ck.weight("f32", (0, 5))
        with pytest.raises(ConfigError):
            ck.weight("f32", (3,))


def test_vectors(tmp_path):
    v = torch.randn(7)
    d = model_dir(
        tmp_path,
        {
            "model.safetensors": {
                "f32": v,
                "bf16": v.bfloat16(),
                "f16": v.half(),
                "i8": torch.zeros(7, dtype=torch.int8),
            }
        },
    )
    with Checkpoint.open(d) as ck:
        a = ck.vector("f32", (7,))
        assert a.dtype == np.float32 and not a.flags.owndata and np.array_equal(a, v.numpy())
        assert np.array_equal(ck.vector("bf16", (7,)), v.bfloat16().float().numpy())
        assert np.array_equal(ck.vector("f16", (7,)), v.half().float().numpy())
        with pytest.raises(CheckpointError, match="expected \\[8\\]"):
            ck.vector("f32", (8,))
        with pytest.raises(CheckpointError, match="I8"):
            ck.vector("i8", (7,))


# ---- FP8 (HF block-scaled) --------------------------------------------------------


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_fp8_dequant_matches_torch(tmp_path, scale_dtype):
    torch.manual_seed(0)
    o, i = 200, 300
    w = (torch.randn(o, i) * 50).to(torch.float8_e4m3fn)
    s = (torch.rand(2, 3) * 0.01 + 1e-4).to(scale_dtype)
    d = model_dir(tmp_path, {"model.safetensors": {"x.weight": w, "x.weight_scale_inv": s}})
    ref = w.float() * s.float().repeat_interleave(128, 0)[:o].repeat_interleave(128, 1)[:, :i]
    with Checkpoint.open(d) as ck:
        got = ck.weight("x.weight", (o, i))
        assert got.fmt is WeightFormat.F32 and got.data.dtype == np.float32
        assert np.array_equal(got.data, ref.numpy())
        assert np.array_equal(ck.dense_f32("x.weight", (o, i)), ref.numpy())


def test_fp8_nan_missing_or_bad_scale(tmp_path):
    raw = torch.zeros(4, 4, dtype=torch.uint8)
    raw[1, 2] = 0x7F
    nan = raw.view(torch.float8_e4m3fn)
    ok = torch.ones(4, 4).to(torch.float8_e4m3fn)
    d = model_dir(
        tmp_path,
        {
            "model.safetensors": {
                "n.weight": nan,
                "n.weight_scale_inv": torch.ones(1, 1),
                "m.weight": ok.clone(),
                "s.weight": ok.clone(),
                "s.weight_scale_inv": torch.ones(2, 1),
                "i.weight": ok,
                "i.weight_scale_inv": torch.full((1, 1), float("inf")),
            }
        },
    )
    with Checkpoint.open(d) as ck:
        with pytest.raises(CheckpointError, match="'n.weight': non-finite weight"):
            ck.weight("n.weight", (4, 4))
        with pytest.raises(CheckpointError, match="without its 'm.weight_scale_inv'"):
            ck.weight("m.weight", (4, 4))
        with pytest.raises(CheckpointError, match="'s.weight_scale_inv'.*expected \\[1, 1\\]"):
            ck.weight("s.weight", (4, 4))
        with pytest.raises(CheckpointError, match="non-finite"):
            ck.weight("i.weight", (4, 4))


# ---- colibri containers -----------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "gs", "o", "i"),
    [
        (WeightFormat.Q8, 0, 6, 130),
        (WeightFormat.Q4, 0, 6, 130),
        (WeightFormat.Q4, 64, 6, 130),
        (WeightFormat.Q4, 32, 5, 96),
        (WeightFormat.Q4, 64, 3, 129),
        (WeightFormat.Q4, 128, 2, 300),
    ],
)
def test_container_format_inference(tmp_path, fmt, gs, o, i):
    w = rand(o, i)
    qw = quant.quantize(w, fmt, group_size=gs)
    d = model_dir(tmp_path, {"out-00001.safetensors": quant.container_tensors("x.weight", qw)})
    with Checkpoint.open(d) as ck:
        got = ck.weight("x.weight", (o, i))
        assert got.fmt is fmt and got.shape == (o, i)
        assert got.group_size == (gs if fmt is WeightFormat.Q4 else 0)
        assert np.array_equal(got.data, qw.data) and got.data.dtype == qw.data.dtype
        assert np.array_equal(got.scales, qw.scales) and got.scales.shape == qw.scales.shape
        assert not got.data.flags.owndata  # a view of the mapping
        assert np.array_equal(ck.dense_f32("x.weight", (o, i)), quant.dequantize(qw))


def test_flat_u8_container_data_is_accepted(tmp_path):
    qw = quant.quantize(rand(4, 10), WeightFormat.Q4, group_size=0)
    tensors = {"x": qw.data.reshape(-1).copy(), "x.qs": qw.scales}
    d = model_dir(tmp_path, {"out-00001.safetensors": tensors})
    with Checkpoint.open(d) as ck:
        assert np.array_equal(ck.weight("x", (4, 10)).data, qw.data)


def test_lying_container_sizes(tmp_path):
    qw = quant.quantize(rand(6, 130), WeightFormat.Q4, group_size=64)
    t = quant.container_tensors("x", qw)
    t["y"] = t["x"][:, :-1].copy()  # one byte short per row
    t["y.qs"] = t["x.qs"]
    t["z"] = t["x"]
    t["z.qs"] = np.zeros((6, 7), np.float32)  # ceil(130/gs) == 7 for no power of two
    t["u"] = t["x"]  # no .qs
    d = model_dir(tmp_path, {"out-00001.safetensors": t})
    with Checkpoint.open(d) as ck:
        with pytest.raises(CheckpointError) as info:
            ck.weight("y", (6, 130))
        msg = str(info.value)
        assert "'y'" in msg and "384 bytes" in msg and "int4-row 390+6" in msg
        assert "int8-row 780+6" in msg
        with pytest.raises(CheckpointError, match="match no format"):
            ck.weight("z", (6, 130))
        with pytest.raises(CheckpointError, match="match no format"):
            ck.weight("x", (6, 131))  # right bytes for 131 too? no: 6*66 != 390
        with pytest.raises(CheckpointError, match="without its .qs"):
            ck.weight("u", (6, 130))


def test_non_finite_container_scale(tmp_path):
    t = container("x", rand(2, 8), WeightFormat.Q8)
    t["x.qs"] = np.array([1.0, np.nan], np.float32)
    d = model_dir(tmp_path, {"out-00001.safetensors": t})
    with Checkpoint.open(d) as ck, pytest.raises(CheckpointError, match="non-finite scale"):
        ck.weight("x", (2, 8))


def test_width_one_ambiguity_defaults_to_q8_unless_stamped(tmp_path):
    w = rand(4, 1)
    q8 = container("a", w, WeightFormat.Q8)
    q4 = container("b", w, WeightFormat.Q4, gs=0)
    stamp = {"colibri.fmt": json.dumps({"b": "int4-row"})}
    d = model_dir(
        tmp_path, {"out-00001.safetensors": {**q8, **q4}}, metadata={"out-00001.safetensors": stamp}
    )
    with Checkpoint.open(d) as ck:
        a = ck.weight("a", (4, 1))
        b = ck.weight("b", (4, 1))
        assert a.fmt is WeightFormat.Q8 and b.fmt is WeightFormat.Q4
        assert np.array_equal(
            ck.dense_f32("b", (4, 1)),
            quant.dequantize(quant.quantize(w, WeightFormat.Q4, group_size=0)),
        )


def test_stamps_verify_and_refuse(tmp_path):
    t = {
        **container("a", rand(4, 64), WeightFormat.Q8),
        **container("b", rand(4, 64), WeightFormat.Q4, 32),
        **container("c", rand(4, 64), WeightFormat.Q4, 32),
        **container("d", rand(4, 64), WeightFormat.Q8),
    }
    stamps = {"a": "int8-row", "b": "int4-grouped", "c": "int8-row", "d": "mxfp4"}
    d = model_dir(
        tmp_path,
        {"out-00001.safetensors": t},
        metadata={"out-00001.safetensors": {"colibri.fmt": json.dumps(stamps)}},
    )
    with Checkpoint.open(d) as ck:
        assert ck.weight("a", (4, 64)).fmt is WeightFormat.Q8
        assert ck.weight("b", (4, 64)).group_size == 32
        with pytest.raises(CheckpointError, match="stamped int8-row but its sizes say int4"):
            ck.weight("c", (4, 64))
        with pytest.raises(CheckpointError, match="'mxfp4' is unsupported"):
            ck.weight("d", (4, 64))


def test_conflicting_or_malformed_stamps(tmp_path):
    m1 = {"colibri.fmt": json.dumps({"a": "int8-row"})}
    m2 = {"colibri.fmt": json.dumps({"a": "int4-row"})}
    d = model_dir(
        tmp_path,
        {"out-00001.safetensors": {"a": rand(2)}, "out-00002.safetensors": {"b": rand(2)}},
        metadata={"out-00001.safetensors": m1, "out-00002.safetensors": m2},
    )
    with pytest.raises(CheckpointError, match="stamped both"):
        Checkpoint.open(d)
    d2 = model_dir(
        tmp_path / "x",
        {"out-00001.safetensors": {"a": rand(2)}},
        metadata={"out-00001.safetensors": {"colibri.fmt": "[1]"}},
    )
    with pytest.raises(CheckpointError, match="colibri.fmt"):
        Checkpoint.open(d2)


def test_group_size_hint_for_non_power_of_two(tmp_path):
    qw = quant.quantize(rand(3, 100), WeightFormat.Q4, group_size=48)
    meta = {"out-00001.safetensors": {"colibri.group_size": "48"}}
    d = model_dir(
        tmp_path, {"out-00001.safetensors": quant.container_tensors("x", qw)}, metadata=meta
    )
    with Checkpoint.open(d) as ck:
        got = ck.weight("x", (3, 100))
        assert got.group_size == 48 and np.array_equal(got.scales, qw.scales)
    bad = {"out-00001.safetensors": {"colibri.group_size": "-1"}}
    d2 = model_dir(
        tmp_path / "b", {"out-00001.safetensors": quant.container_tensors("x", qw)}, metadata=bad
    )
    with Checkpoint.open(d2) as ck, pytest.raises(CheckpointError, match="group_size"):
        ck.weight("x", (3, 100))


def test_fp8_passthrough_container(tmp_path):
    torch.manual_seed(1)
    o, i = 256, 200
    w = (torch.randn(o, i) * 10).to(torch.float8_e4m3fn)
    s = torch.rand(2, 2) + 0.5
    ref = w.float() * s.repeat_interleave(128, 0)[:o].repeat_interleave(128, 1)[:, :i]
    t = {"x": w.view(torch.uint8).numpy(), "x.qs": s.numpy()}
    d = model_dir(tmp_path, {"out-00001.safetensors": t})
    with Checkpoint.open(d) as ck:
        got = ck.weight("x", (o, i))
        assert got.fmt is WeightFormat.F32 and np.array_equal(got.data, ref.numpy())


def test_fp8_vs_int8_collision_defaults_to_int8_unless_stamped(tmp_path):
    # O = 2, I = 200: int8-row wants 2 scales, fp8-e4m3-b128 wants ceil(2/128)*ceil(200/128) = 2
    raw = torch.ones(2, 200).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    t = {"a": raw, "a.qs": np.ones(2, np.float32), "b": raw, "b.qs": np.ones(2, np.float32)}
    meta = {"out-00001.safetensors": {"colibri.fmt": json.dumps({"b": "fp8-e4m3-b128"})}}
    d = model_dir(tmp_path, {"out-00001.safetensors": t}, metadata=meta)
    with Checkpoint.open(d) as ck:
        assert ck.weight("a", (2, 200)).fmt is WeightFormat.Q8
        b = ck.weight("b", (2, 200))
        assert b.fmt is WeightFormat.F32 and np.all(b.data == 1.0)


# ---- matrices of one size signature -------------------------------------------------


def test_same_signature_matrices_are_views_of_their_own_bytes(tmp_path):
    """After the first matrix of a signature, the others are rebuilt from its recipe
    (TypedWeights.weight): each must still be its own bytes, exactly what a fresh
    checkpoint reads for it alone, in every format."""
    t: dict[str, np.ndarray] = {}
    fp4_codes = np.random.default_rng(1).integers(0, 256, (4, 32), dtype=np.uint8)
    for e in range(3):
        t.update(container(f"q8.{e}", rand(4, 64, seed=e), WeightFormat.Q8))
        t.update(container(f"q4.{e}", rand(4, 130, seed=e), WeightFormat.Q4, 64))
        t.update(container(f"row.{e}", rand(4, 130, seed=e), WeightFormat.Q4, 0))
        t[f"f32.{e}"] = rand(4, 8, seed=e)
        t[f"fp4.{e}"] = np.roll(fp4_codes, e)
        t[f"fp4.{e}.qs"] = np.full((4, 2), 120 + e, np.uint8)
    shapes = {"q8": (4, 64), "q4": (4, 130), "row": (4, 130), "f32": (4, 8), "fp4": (4, 64)}
    d = tmp_path / "model"
    model_dir(tmp_path, {"out-00001.safetensors": {k: v for k, v in t.items() if "fp4" not in k}})
    torch_fp4 = {
        k: torch.from_numpy(v).view(torch.float8_e8m0fnu) if k.endswith(".qs") else v
        for k, v in t.items()
        if "fp4" in k
    }
    model_dir(tmp_path, {"out-00002.safetensors": torch_fp4})
    with Checkpoint.open(d) as ck:
        got = {f"{k}.{e}": ck.weight(f"{k}.{e}", s) for k, s in shapes.items() for e in range(3)}
    for name, w in got.items():
        with Checkpoint.open(d) as alone:
            ref = alone.weight(name, shapes[name.split(".")[0]])
        assert (w.fmt, w.shape, w.group_size) == (ref.fmt, ref.shape, ref.group_size)
        assert w.data.dtype == ref.data.dtype and np.array_equal(w.data, ref.data)
        assert (w.scales is None) == (ref.scales is None)
        if ref.scales is not None:
            assert w.scales.dtype == ref.scales.dtype and np.array_equal(w.scales, ref.scales)
        assert not w.data.flags.owndata and not w.data.flags.writeable
    assert got["fp4.1"].fmt is WeightFormat.FP4
    assert not np.array_equal(got["q4.0"].data, got["q4.1"].data)  # not one shared view


@pytest.mark.parametrize("bad", [1, 2])
def test_a_later_matrix_of_a_signature_still_has_its_scales_checked(tmp_path, bad):
    t: dict[str, np.ndarray] = {}
    for e in range(3):
        t.update(container(f"q4.{e}", rand(4, 128, seed=e), WeightFormat.Q4, 64))
    t[f"q4.{bad}.qs"] = t[f"q4.{bad}.qs"].copy()
    t[f"q4.{bad}.qs"][2, 1] = np.inf
    codes = {f"fp4.{e}": np.zeros((2, 16), np.uint8) for e in range(3)}
    scales = {f"fp4.{e}.qs": torch.full((2, 1), 1.0).to(torch.float8_e8m0fnu) for e in range(3)}
    scales[f"fp4.{bad}.qs"] = torch.full((2, 1), float("nan")).to(torch.float8_e8m0fnu)
    d = model_dir(
        tmp_path, {"out-00001.safetensors": t, "out-00002.safetensors": {**codes, **scales}}
    )
    with Checkpoint.open(d) as ck:
        for e in range(3):
            if e == bad:
                with pytest.raises(CheckpointError, match=f"'q4.{e}.qs': non-finite scale"):
                    ck.weight(f"q4.{e}", (4, 128))
                with pytest.raises(CheckpointError, match=f"'fp4.{e}.qs': non-finite scale"):
                    ck.weight(f"fp4.{e}", (2, 32))
            else:
                assert ck.weight(f"q4.{e}", (4, 128)).fmt is WeightFormat.Q4
                assert ck.weight(f"fp4.{e}", (2, 32)).fmt is WeightFormat.FP4
