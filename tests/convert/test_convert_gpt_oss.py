"""`colibri convert` of gpt-oss checkpoints as OpenAI and transformers store them: the
experts fused per layer (``mlp.experts.gate_up_proj`` [E, D, 2F] with gate and up
interleaved, ``down_proj`` [E, F, D]), in float or as MXFP4 (``*_blocks`` packed e2m1 +
``*_scales`` e8m0 per 32 inputs, [out, in] orientation).

The MXFP4 source is encoded here with independent numpy maths and checked against
transformers' own dequantiser (integrations/mxfp4.py), so the nibble order and layout the
converter reads are transformers'. Its reference is transformers on the dequantised
experts: MXFP4 -> f32 experts (``--bits 32``) is lossless, so the container equals the one
converted from the dequantised float source byte for byte and the engine reproduces the
reference token for token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tiny_models
import torch
from quant_reference import EXACT_FLAGS
from safetensors.numpy import save_file
from safetensors.torch import load_file

from colibri_cli.main import main
from colibrid.backends.base import KernelFamily
from colibrid.convert.inspect import inspect
from colibrid.engine.backend import make_ops
from colibrid.engine.engine import Engine
from colibrid.engine.generate import teacher_forced_argmax
from colibrid.formats import quant
from colibrid.formats.weights import WeightFormat
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.options import StoreOptions

mxfp4_encode, mxfp4_decode = tiny_models.mxfp4_encode, tiny_models.mxfp4_decode


def mxfp4_roundtrip(name: str, w: np.ndarray) -> np.ndarray:
    return mxfp4_decode(*mxfp4_encode(w))


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():  # bf16 and e8m0 as their bits, as stored
            if v.dtype == torch.bfloat16:
                out[k] = v.view(torch.int16).numpy().view(np.uint16)
            elif v.dtype == torch.float8_e8m0fnu:
                out[k] = v.view(torch.uint8).numpy()
            else:
                out[k] = v.numpy()
    return out


def _source(ref: tiny_models.OracleReference, dst: Path, mxfp4: bool) -> Path:
    """The oracle folder (per-expert f32 on the MXFP4 grid) re-stored in transformers'
    fused layout, the experts in f32 or MXFP4."""
    if mxfp4:

        def check(blocks: np.ndarray, scales: np.ndarray, fused: np.ndarray) -> None:
            theirs = _transformers_dequant(blocks, scales)
            np.testing.assert_array_equal(theirs, fused)  # transformers reads what we wrote

        return tiny_models.write_mxfp4_source(ref.out_dir, dst, check)
    dst.mkdir()
    fused = tiny_models.fuse_gpt_oss(load_file(str(ref.out_dir / "model.safetensors")))
    save_file(
        {k: t.numpy() for k, t in fused.items()},
        str(dst / "model.safetensors"),
        metadata={"format": "pt"},
    )
    shutil.copy(ref.out_dir / "config.json", dst / "config.json")
    return dst


def _transformers_dequant(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    )
    return out.numpy()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpt-oss")
    ref = tiny_models.build_checkpoint(
        "gpt_oss",
        base / "oracle",
        expert_transform=mxfp4_roundtrip,
        expert_container=lambda name, w: {name: mxfp4_roundtrip(name, w)},
    )
    return ref, _source(ref, base / "f32", False), _source(ref, base / "mxfp4", True)


def _convert(src: Path, dst: Path, bits: str, mxfp4: str = "convert") -> Path:
    args = ["convert", str(src), str(dst), "--bits", bits, "--mxfp4", mxfp4, *EXACT_FLAGS]
    assert main(args) == 0
    return dst


def greedy(engine: Engine, prompt: list[int], n: int = 20) -> list[int]:
    session = engine.new_session()
    logits, out = session.prefill(prompt), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = session.decode(out[-1])
    return out


def test_mxfp4_source_converts_losslessly_to_f32_experts(sources, tmp_path: Path) -> None:
    ref, f32_src, mx_src = sources
    with Checkpoint.open(mx_src) as ck:
        assert any(n.endswith("gate_up_proj_blocks") for n in ck.names())
    from_f32 = _convert(f32_src, tmp_path / "a", "32")
    from_mx = _convert(mx_src, tmp_path / "b", "32")
    a, b = _tensors(from_f32), _tensors(from_mx)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    oracle = _tensors(ref.out_dir)  # the per-expert split the engine's oracle runs on
    for name, w in oracle.items():
        np.testing.assert_array_equal(b[name], w, err_msg=name)
    assert "quantization_config" not in json.loads((from_mx / "config.json").read_text())

    engine = Engine.load(from_mx, family=KernelFamily.F32)
    other = Engine.load(from_f32, family=KernelFamily.F32)
    try:
        assert teacher_forced_argmax(engine, ref.tf_ids) == ref.tf_pred
        logits = engine.new_session().prefill(ref.tf_ids, all_logits=True)
        same = other.new_session().prefill(ref.tf_ids, all_logits=True)
        np.testing.assert_array_equal(logits, same)
    finally:
        engine.close()
        other.close()


def test_mxfp4_source_converts_losslessly_to_bf16_experts(sources, tmp_path: Path) -> None:
    """bf16 holds e2m1 x 2^k exactly: the experts are the f32 container's at half the size."""
    ref, _, mx_src = sources
    dst = _convert(mx_src, tmp_path / "d", "16")
    report = inspect(dst)
    config = tiny_models.tiny_config("gpt_oss")
    assert report.formats["expert"] == {"bf16": 3 * config.num_local_experts * 3}
    stored, oracle = _tensors(dst), _tensors(ref.out_dir)
    for name, w in oracle.items():
        if tiny_models.is_routed_expert(name):
            assert stored[name].dtype == np.uint16
            np.testing.assert_array_equal(quant.bf16_to_f32(stored[name]), w, err_msg=name)
    engine = Engine.load(dst, family=KernelFamily.F32)
    try:
        assert teacher_forced_argmax(engine, ref.tf_ids) == ref.tf_pred
    finally:
        engine.close()


def test_mxfp4_source_converts_to_int4_experts(sources, tmp_path: Path, capsys) -> None:
    """`--mxfp4 convert` (int4-g64 experts) requantises the MXFP4 values, saying so: a
    container the engine loads, the router and the fused expert biases kept in f32."""
    _, _, mx_src = sources
    dst = tmp_path / "c"
    assert main(["convert", str(mx_src), str(dst), "--mxfp4", "convert", *EXACT_FLAGS]) == 0
    assert "--mxfp4 keep (the default) stores them as they are" in capsys.readouterr().err
    report = inspect(dst)
    config = tiny_models.tiny_config("gpt_oss")
    n_routed = 3 * config.num_local_experts * config.num_hidden_layers
    assert report.formats["expert"] == {"int4-g64": n_routed}
    assert set(report.formats["f32"]) == {"f32"}
    engine = Engine.load(dst, family=KernelFamily.F32)
    engine.close()


def test_unconverted_fused_checkpoint_is_refused_with_a_hint(sources, tmp_path: Path) -> None:
    _, f32_src, _ = sources
    folder = tmp_path / "raw"
    shutil.copytree(f32_src, folder)
    with pytest.raises(Exception, match="colibri convert"):
        Engine.load(folder, family=KernelFamily.F32)


def test_mxfp4_experts_are_kept_at_4_bits_by_default(sources, tmp_path: Path, capsys) -> None:
    """The default keeps MXFP4 experts as stored (FP4): the source's codes and e8m0 bytes
    byte for byte, the size of MXFP4, no note about requantising; the engine reproduces
    transformers on the dequantised experts token for token (greedy 20/20, teacher-forced)
    with the experts resident or streamed, and runs the I8 family on them too."""
    ref, _, mx_src = sources
    dst = tmp_path / "fp4"
    assert main(["convert", str(mx_src), str(dst), *EXACT_FLAGS]) == 0
    assert "requantises" not in capsys.readouterr().err
    config = tiny_models.tiny_config("gpt_oss")
    n_routed = 3 * config.num_local_experts * config.num_hidden_layers
    assert inspect(dst).formats["expert"] == {"fp4-e2m1-g32": n_routed}
    stored, source = _tensors(dst), _tensors(mx_src)
    f = config.intermediate_size
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        blocks = source[f"{prefix}.gate_up_proj_blocks"]  # [E, 2F, G, 16], gate rows even
        scales = source[f"{prefix}.gate_up_proj_scales"]
        down_b, down_s = source[f"{prefix}.down_proj_blocks"], source[f"{prefix}.down_proj_scales"]
        for e in range(config.num_local_experts):
            for name, b, sc in (
                ("gate_proj", blocks[e, 0::2], scales[e, 0::2]),
                ("up_proj", blocks[e, 1::2], scales[e, 1::2]),
                ("down_proj", down_b[e], down_s[e]),
            ):
                key = f"{prefix}.{e}.{name}.weight"
                np.testing.assert_array_equal(stored[key], b.reshape(b.shape[0], -1))
                np.testing.assert_array_equal(stored[key + ".qs"], sc)
        assert stored[f"{prefix}.0.gate_proj.weight"].shape[0] == f
    with Checkpoint.open(dst) as ck:
        w = ck.weight("model.layers.0.mlp.experts.1.down_proj.weight", (config.hidden_size, f))
        assert w.fmt is WeightFormat.FP4 and w.scales.dtype == np.uint8
        np.testing.assert_array_equal(
            quant.dequantize(w),
            _tensors(ref.out_dir)["model.layers.0.mlp.experts.1.down_proj.weight"],
        )
    for store in (StoreOptions(mode="resident"), StoreOptions(mode="tiered", cache=1)):
        engine = Engine.load(dst, family=KernelFamily.F32, store=store)
        try:
            assert greedy(engine, ref.prompt_ids) == ref.greedy_ids, store
            assert teacher_forced_argmax(engine, ref.tf_ids) == ref.tf_pred, store
        finally:
            engine.close()
    engine = Engine.load(dst, family=KernelFamily.I8)
    try:
        assert len(greedy(engine, ref.prompt_ids, 4)) == 4
    finally:
        engine.close()


def test_fp4_experts_on_mlx_match_transformers(sources, tmp_path: Path) -> None:
    """The MLX backend computes the kept MXFP4 experts in its own mxfp4 mode: transformers'
    tokens, teacher-forced and greedy."""
    pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'colibri[mlx]')")
    ref, _, mx_src = sources
    dst = tmp_path / "fp4"
    assert main(["convert", str(mx_src), str(dst), *EXACT_FLAGS]) == 0
    engine = Engine.load(dst, family=KernelFamily.F32, ops=make_ops("mlx"))
    try:
        assert teacher_forced_argmax(engine, ref.tf_ids) == ref.tf_pred
        assert greedy(engine, ref.prompt_ids) == ref.greedy_ids
    finally:
        engine.close()
