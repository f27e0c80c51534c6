"""The GGUF twin of a GLM-4.5-shaped container (bench/gguf_export.py, for `colibri bench
peer --far`): llama.cpp's names and metadata, and the same weights — every int4 code
unchanged, only the scale rounded to f16 — read back with the `gguf` package."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from colibri_cli.main import main
from colibrid.bench.gguf_export import export
from colibrid.errors import ConvertError
from colibrid.formats.quant import dequantize
from colibrid.store.checkpoint import Checkpoint

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def container(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("air") / "m"
    args = ["synth", "--shape", "glm4-tiny", "--layers", "3", "--experts", "4", "--quiet"]
    assert main([*args, str(d)]) == 0
    return d


def _f16_scales(w):  # noqa: ANN001, ANN202
    """The container weight with its scales rounded to f16, as Q4_0/Q8_0 store them."""
    from dataclasses import replace

    return replace(w, scales=np.asarray(w.scales).astype(np.float16).astype(np.float32))


def test_export_keeps_the_codes_and_llama_cpp_names(container: Path, tmp_path: Path) -> None:
    out = export(container, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf.part").exists()
    reader = gguf.GGUFReader(out)
    fields = {f.name: f for f in reader.fields.values()}
    assert reader.fields["general.architecture"].contents() == "glm4moe"
    for key, want in (
        ("glm4moe.block_count", 3),
        ("glm4moe.expert_count", 4),
        ("glm4moe.expert_used_count", 2),
        ("glm4moe.leading_dense_block_count", 1),
        ("glm4moe.attention.key_length", 32),
        ("glm4moe.rope.dimension_count", 16),
        ("glm4moe.vocab_size", 320),
    ):
        assert fields[key].contents() == want, key
    tensors = {t.name: t for t in reader.tensors}
    ckpt = Checkpoint.open(container)
    try:
        checks = {
            "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", (128, 128)),
            "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj.weight", (128, 192)),
            "token_embd.weight": ("model.embed_tokens.weight", (320, 128)),
            "blk.2.ffn_gate_shexp.weight": (
                "model.layers.2.mlp.shared_experts.gate_proj.weight",
                (64, 128),
            ),
        }
        for theirs, (ours, shape) in checks.items():
            got = gguf.dequantize(tensors[theirs].data, tensors[theirs].tensor_type)
            want = dequantize(_f16_scales(ckpt.weight(ours, shape)))
            np.testing.assert_allclose(got.reshape(shape), want, rtol=0, atol=1e-6)
        stack = tensors["blk.1.ffn_up_exps.weight"]
        assert stack.tensor_type == gguf.GGMLQuantizationType.Q4_0
        got = gguf.dequantize(stack.data, stack.tensor_type).reshape(4, 64, 128)
        for e in range(4):
            w = ckpt.weight(f"model.layers.1.mlp.experts.{e}.up_proj.weight", (64, 128))
            np.testing.assert_allclose(got[e], dequantize(_f16_scales(w)), rtol=0, atol=1e-6)
        bias = tensors["blk.1.exp_probs_b.bias"].data
        np.testing.assert_array_equal(
            bias, ckpt.vector("model.layers.1.mlp.gate.e_score_correction_bias", (4,))
        )
        assert "blk.0.ffn_gate_inp.weight" not in tensors  # layer 0 is dense
    finally:
        ckpt.close()


def test_export_refuses_another_family(tmp_path: Path) -> None:
    d = tmp_path / "glm5"
    assert (
        main(["synth", "--shape", "tiny", "--layers", "2", "--experts", "2", "--quiet", str(d)])
        == 0
    )
    with pytest.raises(ConvertError, match="glm4_moe"):
        export(d, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
