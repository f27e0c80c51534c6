"""`colibri export MODEL --gguf OUT`: the GGUF llama.cpp loads, checked three ways.

* Read back with the `gguf` package (always): llama.cpp's names and keys, and the same
  weights: every code unchanged, only Q4_0/Q8_0's scales rounded to f16; Q2/Q3 and MXFP4
  bit for bit; shards with llama.cpp's split keys; resume after an interruption gives the
  bytes of an uninterrupted export; refusals are one line.
* Run by llama.cpp, through each way it runs here: its Python binding (the optional extra
  colibri[peer], what `colibri bench gguf` uses) and its own `llama-server` driven over
  HTTP (built by `colibri llama-build`, as CI does before pytest; tests/helpers/
  llama_server.py): the demo's greedy continuations equal colibri's, its tokenizer gives
  colibri's ids, the chat template is there, a split export loads from its first shard,
  and a tiny model of each family loads and decodes as colibri does.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import numpy as np
import pytest
from daemon_helpers import install_chat_tokenizer
from helpers.llama_server import LlamaServer, llama_binaries

from colibri_cli.main import main
from colibrid.bench import gguf_agree
from colibrid.cluster.llama_build import cached, missing_tools
from colibrid.convert import gguf_export
from colibrid.convert.gguf_arch import family_of
from colibrid.convert.gguf_blocks import choose, encode
from colibrid.errors import ConvertError
from colibrid.formats import affine, quant
from colibrid.formats.weights import QuantWeight, WeightFormat
from colibrid.store.checkpoint import Checkpoint

gguf = pytest.importorskip("gguf")


class LlamaPeer(Protocol):
    """What these tests ask llama.cpp about one GGUF."""

    def tokenize(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...

    def greedy(self, prompts: Sequence[list[int]], tokens: int) -> list[list[int]]: ...

    def teacher_forced(
        self, prompts: Sequence[list[int]], continuations: Sequence[list[int]]
    ) -> list[list[int]]: ...

    def close(self) -> None: ...


class BindingPeer:
    """llama.cpp through its Python binding: `colibri bench gguf`'s own functions, and the
    binding's tokenizer where a check needs a BOS added or pieces back."""

    def __init__(self, path: Path) -> None:
        import llama_cpp

        self.path = path
        self.vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)

    def tokenize(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        if not add_bos:
            return gguf_agree.llama_tokenize(self.path, texts)
        return [self.vocab.tokenize(t.encode(), add_bos=True, special=True) for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        # without a leading BOS the binding strips nothing: the pieces as llama.cpp has them
        assert not ids or ids[0] != self.vocab.token_bos()
        return self.vocab.detokenize(list(ids)).decode()

    def greedy(self, prompts: Sequence[list[int]], tokens: int) -> list[list[int]]:
        return gguf_agree.llama_greedy(self.path, list(prompts), tokens)

    def teacher_forced(
        self, prompts: Sequence[list[int]], continuations: Sequence[list[int]]
    ) -> list[list[int]]:
        return gguf_agree.llama_teacher_forced(self.path, list(prompts), list(continuations))

    def close(self) -> None:
        self.vocab.close()


def _ways_to_run_llama_cpp() -> list[str]:
    """Every way llama.cpp runs on this machine; CI has the server only."""
    ways = ["binding"] if importlib.util.find_spec("llama_cpp") else []
    if cached() is not None or missing_tools() is None:
        ways.append("server")
    return ways or ["none"]


@pytest.fixture(scope="module", params=_ways_to_run_llama_cpp())
def open_llama(request, tmp_path_factory) -> Iterator[Callable[[Path], LlamaPeer]]:
    """Opens llama.cpp on a GGUF, the binding's or a `llama-server` of its own (one per
    GGUF: the caller closes it)."""
    if request.param == "none":  # the checks before llama.cpp's still run

        def cannot(path: Path) -> LlamaPeer:
            pytest.skip(
                "llama.cpp cannot run here: its binding (the optional extra colibri[peer]) is "
                f"not installed and its server cannot be built ({missing_tools()})"
            )

        yield cannot
        return
    if request.param == "binding":
        yield BindingPeer
        return
    binaries = llama_binaries()
    logs = tmp_path_factory.mktemp("llama-server")

    def start(path: Path) -> LlamaPeer:
        return LlamaServer(binaries, path, logs / f"{path.stem}-{len(list(logs.iterdir()))}.log")

    yield start


@pytest.fixture
def llama(open_llama) -> Iterator[Callable[[Path], LlamaPeer]]:
    """llama.cpp on a GGUF for one test, closed after it."""
    opened: list[LlamaPeer] = []

    def get(path: Path) -> LlamaPeer:
        opened.append(open_llama(path))
        return opened[-1]

    yield get
    for peer in opened:
        peer.close()


@pytest.fixture(scope="module")
def container(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("air") / "m"
    args = ["synth", "--shape", "glm4-tiny", "--layers", "3", "--experts", "4", "--quiet"]
    assert main([*args, str(d)]) == 0
    return d


def _f16_scales(w: QuantWeight) -> QuantWeight:
    """The container weight with its scales rounded to f16, as Q4_0/Q8_0 store them."""
    return replace(w, scales=np.asarray(w.scales).astype(np.float16).astype(np.float32))


def _fields(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {name: f.contents() for name, f in reader.fields.items() if name != "GGUF.kv_count"}


# ---- read back -----------------------------------------------------------------------


def test_export_keeps_the_codes_and_llama_cpp_names(container: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    assert main(["export", str(container), "--gguf", str(out), "--quiet", "--no-tokenizer"]) == 0
    assert not list(tmp_path.glob("*.partial"))
    reader = gguf.GGUFReader(out)
    fields = {f.name: f for f in reader.fields.values()}
    assert reader.fields["general.architecture"].contents() == "glm4moe"
    assert reader.fields["tokenizer.ggml.model"].contents() == "none"  # --no-tokenizer
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
    with Checkpoint.open(container) as ckpt:
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
            want = quant.dequantize(_f16_scales(ckpt.weight(ours, shape)))
            np.testing.assert_allclose(got.reshape(shape), want, rtol=0, atol=1e-6)
        stack = tensors["blk.1.ffn_up_exps.weight"]
        assert stack.tensor_type == gguf.GGMLQuantizationType.Q4_0
        got = gguf.dequantize(stack.data, stack.tensor_type).reshape(4, 64, 128)
        for e in range(4):
            w = ckpt.weight(f"model.layers.1.mlp.experts.{e}.up_proj.weight", (64, 128))
            np.testing.assert_allclose(got[e], quant.dequantize(_f16_scales(w)), rtol=0, atol=1e-6)
        bias = tensors["blk.1.exp_probs_b.bias"].data
        np.testing.assert_array_equal(
            bias, ckpt.vector("model.layers.1.mlp.gate.e_score_correction_bias", (4,))
        )
        assert "blk.0.ffn_gate_inp.weight" not in tensors  # layer 0 is dense


def _roundtrip(w: QuantWeight, ggml: str) -> np.ndarray:
    data = encode(w, ggml)
    return gguf.dequantize(data, gguf.GGMLQuantizationType[ggml]).reshape(w.shape)


def test_low_bit_and_mxfp4_blocks_are_bit_exact() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 128)).astype(np.float32)
    for fmt in (WeightFormat.Q2, WeightFormat.Q3):
        w = affine.quantize_affine(x, fmt)
        assert choose([w]).ggml == "Q4_1"
        np.testing.assert_array_equal(_roundtrip(w, "Q4_1"), quant.dequantize(w))
    codes = rng.integers(0, 256, (8, 64), dtype=np.uint8)
    e8m0 = rng.integers(120, 135, (8, 4), dtype=np.uint8)
    fp4 = QuantWeight(WeightFormat.FP4, (8, 128), codes, e8m0, 32)
    assert choose([fp4]).ggml == "MXFP4"
    np.testing.assert_array_equal(_roundtrip(fp4, "MXFP4"), quant.dequantize(fp4))
    # experts mixing int4 with Q2: one Q4_1 tensor holds both exactly (int4 at f16 scales)
    q4 = quant.quantize(x, WeightFormat.Q4, 64)
    q2 = affine.quantize_affine(x, WeightFormat.Q2)
    assert choose([q4, q2]).ggml == "Q4_1"
    np.testing.assert_array_equal(_roundtrip(q4, "Q4_1"), quant.dequantize(_f16_scales(q4)))
    # int4 beside int8: Q8_0 holds the int4 codes at their scale
    q8 = quant.quantize(x, WeightFormat.Q8)
    assert choose([q4, q8]).ggml == "Q8_0"
    np.testing.assert_array_equal(_roundtrip(q4, "Q8_0"), quant.dequantize(_f16_scales(q4)))
    # a row that is not whole blocks of 32: its exact f32 values, and why
    odd = quant.quantize(x[:, :100], WeightFormat.Q8)
    enc = choose([odd])
    assert enc.ggml == "F32" and "blocks of 32" in (enc.fallback or "")


def test_refusals_are_one_line(container: Path, tmp_path: Path) -> None:
    cfg = json.loads((container / "config.json").read_text())
    for change, words in (
        ({"model_type": "llama"}, "cannot export model_type 'llama'"),
        ({"model_type": "qwen3_moe", "mlp_only_layers": [1]}, "qwen3moe has no dense layers"),
        ({"model_type": "mixtral", "sliding_window": 8}, "no sliding window"),
        ({"model_type": "gpt_oss", "swiglu_limit": 1.5}, "swiglu_limit 7.0"),
        ({"model_type": "olmoe", "num_key_value_heads": 1}, "no grouped-query attention"),
        ({"model_type": "glm_moe_dsa", "index_head_dim": 32}, "index_head_dim 128"),
    ):
        with pytest.raises(ConvertError, match=words):
            family_of({**cfg, **change})
    other = tmp_path / "other"
    shutil.copytree(container, other)
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    out = tmp_path / "x.gguf"
    r = subprocess.run(
        [sys.executable, "-m", "colibri_cli", "export", str(other), "--gguf", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "colibri export: error: cannot export model_type 'llama' to GGUF (exportable: "
        "deepseek_v3, deepseek_v32, glm4_moe, glm_moe_dsa, gpt_oss, mixtral, olmoe, qwen3_moe)"
    ]
    assert not out.exists()
    out.write_bytes(b"not ours")
    with pytest.raises(ConvertError, match="not an export colibri started"):
        gguf_export.export(container, out)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri_cli",
            "export",
            "x",
            "--gguf",
            "y",
            "--split-max-size",
            "z",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "not a size: 'z'" in r.stderr


def _split(container: Path, out: Path) -> list[Path]:
    r = gguf_export.run(container, out, gguf_export.ExportOptions(split_max_bytes=100_000))
    return r.files


def test_shards_carry_llama_cpp_split_keys(container: Path, tmp_path: Path) -> None:
    files = _split(container, tmp_path / "m.gguf")
    assert len(files) >= 3
    assert [f.name for f in files] == [
        f"m-{i:05d}-of-{len(files):05d}.gguf" for i in range(1, len(files) + 1)
    ]
    total = 0
    for i, f in enumerate(files):
        fields = _fields(f)
        assert fields["split.no"] == i and fields["split.count"] == len(files)
        total += len(gguf.GGUFReader(f).tensors)
        assert ("glm4moe.block_count" in fields) == (i == 0)  # the keys live in the first
    assert _fields(files[0])["split.tensors.count"] == total


def test_resume_after_an_interruption_gives_the_same_bytes(
    container: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    whole = _split(container, tmp_path / "a" / "m.gguf")
    real = gguf_export._write_shard
    calls = []

    def interrupted(path, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append(path.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the user's ^C, in the middle of the export
        return real(path, *args, **kwargs)

    (tmp_path / "b").mkdir()
    out = tmp_path / "b" / "m.gguf"
    monkeypatch.setattr(gguf_export, "_write_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _split(container, out)
    monkeypatch.setattr(gguf_export, "_write_shard", real)
    first = whole[0].name
    kept = (tmp_path / "b" / first).stat()
    marker = json.loads(gguf_export.marker_path(out).read_text())
    assert list(marker["shards"]) == [first] and marker["complete"] is False
    with pytest.raises(ConvertError, match="different options"):
        gguf_export.run(container, out, gguf_export.ExportOptions(split_max_bytes=120_000))
    resumed = _split(container, out)
    assert (tmp_path / "b" / first).stat().st_mtime_ns == kept.st_mtime_ns  # not rewritten
    for a, b in zip(whole, resumed, strict=True):
        assert a.name == b.name and a.read_bytes() == b.read_bytes()
    assert not list((tmp_path / "b").glob(".*.partial"))
    again = gguf_export.run(container, out, gguf_export.ExportOptions(split_max_bytes=100_000))
    assert again.written_bytes == 0  # complete: nothing to do


# ---- run by llama.cpp ------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_export(demo_container: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo-gguf") / "demo.gguf"
    assert main(["export", str(demo_container), "--gguf", str(out), "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def demo_llama(open_llama, demo_export: Path) -> Iterator[LlamaPeer]:
    """llama.cpp on the demo's GGUF, shared by the checks that read it."""
    peer = open_llama(demo_export)
    yield peer
    peer.close()


def test_demo_tokenizer_and_chat_template_come_along(
    demo_container: Path, demo_export: Path, open_llama, request: pytest.FixtureRequest
) -> None:
    fields = _fields(demo_export)
    config = json.loads((demo_container / "tokenizer_config.json").read_text())
    assert fields["tokenizer.chat_template"] == config["chat_template"]
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "smollm"
    assert fields["tokenizer.ggml.eos_token_id"] == 2 and fields["tokenizer.ggml.bos_token_id"] == 1
    from colibrid.engine.tokenizer import TextCodec

    codec = TextCodec.load(demo_container)
    texts = [
        "Hello, world! 12345 naïve café 🙂",
        "  leading spaces\nand\ttabs  ",
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
        "def f(x):\n    return x ** 2  # 3.14159",
    ]
    want = [codec.encode(t, add_special_tokens=False) for t in texts]
    demo_llama: LlamaPeer = request.getfixturevalue("demo_llama")
    assert demo_llama.tokenize(texts) == want


def _agreement(model: Path, gguf: Path, llama: LlamaPeer, n_prompts: int, tokens: int) -> dict:
    """`colibri bench gguf`'s figures (gguf_agree.run's), with llama.cpp run as `llama`."""
    from colibrid.engine.tokenizer import TextCodec

    codec = TextCodec.load(model)
    prompts = gguf_agree.PROMPTS[:n_prompts]
    texts = [codec.render_chat([{"role": "user", "content": p}]) for p in prompts]
    ids = [codec.encode(t, add_special_tokens=False) for t in texts]
    ours = gguf_agree.colibri_greedy(model, ids, tokens)
    theirs = llama.greedy(ids, tokens)
    agree = [gguf_agree.common_prefix(a, b) for a, b in zip(ours, theirs, strict=True)]
    forced = llama.teacher_forced(ids, ours)
    pairs = [(x, y) for a, b in zip(ours, forced, strict=True) for x, y in zip(a, b, strict=True)]
    return {
        "model": str(model),
        "gguf": str(gguf),
        "prompts": len(ids),
        "tokens_per_prompt": tokens,
        "tokenizer_equal": sum(a == b for a, b in zip(ids, llama.tokenize(texts), strict=True)),
        "agree_prefix": agree,
        "agree_tokens": sum(agree),
        "decoded_tokens": tokens * len(ids),
        "identical_prompts": sum(a == tokens for a in agree),
        "teacher_forced_agree": sum(x == y for x, y in pairs),
    }


def test_demo_greedy_tokens_agree_with_colibri(
    demo_container: Path, demo_export: Path, demo_llama: LlamaPeer
) -> None:
    r = _agreement(demo_container, demo_export, demo_llama, 8, 16)
    report = gguf_agree.report(r)
    print(report)
    assert r["tokenizer_equal"] == r["prompts"]
    # llama.cpp computes Q4_0/Q8_0 products on int8-quantised activations, colibri's
    # default kernels in f32: a near-tie may flip, so a prefix can end early (the
    # measured figures: docs/performance.md "GGUF export"); a wrong export agrees nowhere
    assert all(n >= 1 for n in r["agree_prefix"]), report
    assert r["identical_prompts"] >= r["prompts"] // 2, report
    assert r["teacher_forced_agree"] >= 0.9 * r["decoded_tokens"], report


def test_split_demo_loads_from_its_first_shard(
    demo_container: Path, demo_llama: LlamaPeer, llama, tmp_path: Path
) -> None:
    options = gguf_export.ExportOptions(split_max_bytes=150_000_000)
    files = gguf_export.run(demo_container, tmp_path / "d.gguf", options).files
    assert len(files) >= 3
    from colibrid.engine.tokenizer import TextCodec

    codec = TextCodec.load(demo_container)
    text = codec.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    prompt = [codec.encode(text, add_special_tokens=False)]
    assert llama(files[0]).greedy(prompt, 12) == demo_llama.greedy(prompt, 12)


FAMILY_OVERRIDES = {
    "qwen3_moe": {"mlp_only_layers": []},
    "olmoe": {"num_key_value_heads": 4},
    "mixtral": {"sliding_window": None},
    "gpt_oss": {"swiglu_limit": 7.0},
    # llama.cpp's DSA indexer aborts its graph unless index_head_dim is 128 (the real
    # models'); a top-k past the sequence keeps every key: on tiny models the index scores
    # tie exactly (tests/oracle/tiny_models.py), where the keys kept are the engine's choice
    "glm_moe_dsa": {"index_head_dim": 128, "index_topk": 64},
    "deepseek_v32": {"index_head_dim": 128, "index_topk": 64},
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch",
    [
        "glm4_moe",
        "deepseek_v3",
        "qwen3_moe",
        "olmoe",
        "mixtral",
        "gpt_oss",
        "glm_moe_dsa",
        "deepseek_v32",
    ],
)
def test_each_family_loads_in_llama_cpp_and_decodes_as_colibri(
    arch: str, oracle_checkpoint, llama, tmp_path: Path
) -> None:
    ref = oracle_checkpoint(
        arch, "f32", with_mtp=False, config_overrides=FAMILY_OVERRIDES.get(arch)
    )
    src = tmp_path / "hf"
    shutil.copytree(ref.out_dir, src)
    install_chat_tokenizer(src)  # llama-server turns each token it generates into text
    box = tmp_path / "c"
    assert main(["convert", str(src), str(box), "--quiet"]) == 0
    out = tmp_path / f"{arch}.gguf"
    assert main(["export", str(box), "--gguf", str(out), "--quiet"]) == 0
    prompt = [list(ref.prompt_ids)]
    ours = gguf_agree.colibri_greedy(box, prompt, 8)
    theirs = llama(out).teacher_forced(prompt, ours)
    # teacher-forced top-1 on colibri's continuation: llama.cpp's int8 activations move
    # logits of a random tiny model by ~0.05-0.3 (measured), which flips a near-tie now
    # and then; a wrong name, key or layout differs nearly everywhere
    same = sum(a == b for a, b in zip(ours[0], theirs[0], strict=True))
    assert ours[0][0] == theirs[0][0] and same >= 6, (ours, theirs)


# ---- a SentencePiece-style tokenizer (Mixtral's kind) ----------------------------------

_SPM_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "A tokenizer cuts text into pieces; the model reads the pieces as numbers.",
    "Mixture of experts models route each token to a few experts out of many.",
    "Numbers like 12345 and 3.14159 are split into digits and dots.",
    "Spaces  and   runs of spaces, tabs\tand new\nlines all need care.",
]
_SPM_SPECIALS = ["<unk>", "<s>", "</s>"]
_SPM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
    "{{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def _llama_style_tokenizer(space: str, vocab_size: int):  # noqa: ANN202
    """A tokenizer laid out as Hugging Face stores Llama's and Mixtral's: <unk> <s> </s>,
    the 256 byte tokens, then a BPE trained here (within words, as SentencePiece trains),
    byte fallback, spaces as "▁" through the legacy normalizer or a Metaspace."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    words = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    words.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    n_merged = vocab_size - 256  # the trainer's vocabulary: specials, alphabet, merges
    trainer = trainers.BpeTrainer(
        vocab_size=n_merged, special_tokens=_SPM_SPECIALS, show_progress=False
    )
    words.train_from_iterator(_SPM_TEXT * 4, trainer)
    trained = json.loads(words.to_str())["model"]
    vocab = {s: i for i, s in enumerate(_SPM_SPECIALS)}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for text, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(text, len(vocab))
    merges = [tuple(m) for m in trained["merges"]]
    assert len(merges) > 40 and len(vocab) <= vocab_size
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if space == "normalizer":  # Mixtral's tokenizer.json
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:  # what transformers writes for a non-legacy Llama tokenizer
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _SPM_SPECIALS])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


@pytest.fixture(scope="module")
def mixtral_source(oracle_checkpoint) -> Path:
    ref = oracle_checkpoint(
        "mixtral", "f32", with_mtp=False, config_overrides={"sliding_window": None}
    )
    return ref.out_dir


@pytest.mark.parametrize("space", ["normalizer", "metaspace"])
def test_sentencepiece_tokenizer_tokenises_in_llama_cpp_as_in_tokenizers(
    space: str, mixtral_source: Path, llama, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    src = tmp_path / "hf"
    shutil.copytree(mixtral_source, src)
    n_vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    tok = _llama_style_tokenizer(space, n_vocab)
    tok.save(str(src / "tokenizer.json"))
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": _SPM_TEMPLATE,
    }
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    box = tmp_path / "c"
    assert main(["convert", str(src), str(box), "--quiet"]) == 0
    out = tmp_path / "m.gguf"
    capsys.readouterr()
    assert main(["export", str(box), "--gguf", str(out), "--quiet"]) == 0
    note = capsys.readouterr().err
    assert "SentencePiece-style BPE (byte fallback), with chat template" in note
    # a Metaspace skips the "▁" prefix where llama.cpp adds it: said, and checked below
    assert ("one more leading space" in note) == (space == "metaspace")

    fields = _fields(out)
    assert fields["general.architecture"] == "llama"
    assert fields["tokenizer.ggml.model"] == "llama"
    assert fields["tokenizer.ggml.add_space_prefix"] is True
    assert fields["tokenizer.ggml.add_bos_token"] is True
    assert fields["tokenizer.chat_template"] == _SPM_TEMPLATE
    for key, want in (("unknown", 0), ("bos", 1), ("eos", 2)):
        assert fields[f"tokenizer.ggml.{key}_token_id"] == want, key
    types = fields["tokenizer.ggml.token_type"]
    t = gguf.TokenType
    assert types[:4] == [t.UNKNOWN, t.CONTROL, t.CONTROL, t.BYTE] and types[258] == t.BYTE
    assert all(x == t.NORMAL for x in types[259 : tok.get_vocab_size()])
    assert all(x == t.UNUSED for x in types[tok.get_vocab_size() :])

    texts = [
        "Hello world",
        "The quick brown fox jumps over the lazy dog.",
        "  two leading spaces,  double   and triple ",
        "digits 12345 and 3.14159 and 2026",
        "naïve café, Ünïcödé and 日本語",
        "an emoji 🙂 needs bytes",
        "tabs\tand\nnewlines\n\nhere",
        "MIXTURE of Experts",
    ]
    if space == "normalizer":  # llama.cpp puts "▁" after a special token, as this form does
        texts.append("<s>[INST] the lazy fox [/INST] numbers</s>")
    peer = llama(out)
    for text in texts:
        want = tok.encode(text, add_special_tokens=False).ids
        if space == "metaspace" and text.startswith(" "):
            want = tok.encode(" " + text, add_special_tokens=False).ids
            assert want != tok.encode(text, add_special_tokens=False).ids
        (got,) = peer.tokenize([text])
        assert got == want, (text, tok.encode(text, add_special_tokens=False).tokens)
        assert peer.tokenize([text], add_bos=True) == [[1, *want]]
        if "<s>" not in text:  # the pieces carry the space llama.cpp prefixes
            assert peer.detokenize(got) == " " + text
            assert tok.decode(want) == text
    emoji = tok.encode("🙂", add_special_tokens=False).tokens
    assert emoji == ["▁", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]  # byte fallback tested


def test_sentencepiece_tokenizers_llama_cpp_would_cut_differently_are_refused(
    tmp_path: Path,
) -> None:
    from colibrid.convert.gguf_vocab import add_tokenizer

    good = json.loads(_llama_style_tokenizer("normalizer", 384).to_str())
    nfkc = {"type": "NFKC"}
    split = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}
    cases = [
        (
            {
                "model": {**good["model"], "vocab": {**good["model"]["vocab"], "a▁b": 383}},
                "normalizer": None,
                "pre_tokenizer": split,
            },
            "token 'a▁b' spans a split",
        ),
        ({"normalizer": {"type": "Sequence", "normalizers": [nfkc]}}, "normalizer step"),
        ({"normalizer": None}, "through neither"),
        ({"pre_tokenizer": split}, "through both a normalizer and a Metaspace"),
        (
            {
                "model": {
                    **good["model"],
                    "vocab": {k: v for k, v in good["model"]["vocab"].items() if k != "<0x41>"},
                }
            },
            "without 1 of the byte tokens \\(first: <0x41>\\)",
        ),
    ]
    cfg = {"vocab_size": 384}
    cases.append(({}, None))  # the tokenizer as trained: accepted, but not with a regex name
    for i, (change, words) in enumerate(cases):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "tokenizer.json").write_text(json.dumps({**good, **change}))
        w = gguf.GGUFWriter(folder / "x.gguf", "llama")
        if words is None:
            assert "SentencePiece-style" in add_tokenizer(w, folder, cfg, None)
            with pytest.raises(ConvertError, match="--tokenizer-pre 'llama-bpe': .* leave it out"):
                add_tokenizer(gguf.GGUFWriter(folder / "y.gguf", "llama"), folder, cfg, "llama-bpe")
            continue
        with pytest.raises(ConvertError, match=words):
            add_tokenizer(w, folder, cfg, None)
