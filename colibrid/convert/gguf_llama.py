"""Read a dense Llama GGUF file (llama.cpp's format) into Hugging Face terms.

Used by ``colibri pull demo`` to build the built-in demo model from SmolLM2-135M-Instruct
(shipped as a Q4_1 GGUF). Three things need care:

* **Dequantisation** goes through the ``gguf`` package (Q4_1, Q8_0, F16, F32, ...), giving
  f32 matrices already in the ``[out, in]`` orientation of a Hugging Face weight.
* **q/k rows.** llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` so the
  two rotary halves are interleaved (its RoPE rotates adjacent pairs). Hugging Face's
  ``rotate_half`` convention wants them back in halves; :func:`reverse_permute` is the
  exact inverse (the same as transformers' GGUF loader).
* **Tokenizer.** ``tokenizer.ggml.*`` holds a GPT-2 style byte-level BPE (tokens already
  spelled in the byte alphabet, merges as ``"a b"`` strings). :func:`build_tokenizer_json`
  rebuilds a ``tokenizers`` ``tokenizer.json`` from it; control tokens (type 3) become
  special added tokens so ``<|im_start|>`` stays whole. The pre-tokenizer follows
  llama.cpp's ``smollm`` pre-tokenizer (digits split one by one, then the GPT-2 regex),
  which is SmolLM2's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from colibrid.errors import ConvertError

CONTROL = 3  # llama.cpp token type: control (special) token
USER_DEFINED = 4


@dataclass
class DenseLlama:
    """A dense Llama model in Hugging Face names (f32 numpy) plus its text side."""

    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    rms_eps: float
    context: int
    weights: dict[str, np.ndarray]
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None
    meta: dict[str, object] = field(default_factory=dict)

    @property
    def tied(self) -> bool:
        return "lm_head.weight" not in self.weights


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> halves)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _field(reader, key: str, default=None):  # type: ignore[no-untyped-def]
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


_GGUF_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_pre_tokenizer(path: str | Path) -> str | None:
    """The GGUF's `tokenizer.ggml.pre` (how its tokenizer pre-splits text), read without
    dequantising anything."""
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - gguf is a runtime dependency
        raise ConvertError(f"reading GGUF needs the `gguf` package ({exc})") from None
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ConvertError(f"{path}: not a readable GGUF file ({exc})") from None
    pre = _field(reader, "tokenizer.ggml.pre")
    return None if pre is None else str(pre)


def read_llama_gguf(path: str | Path) -> DenseLlama:
    """Dequantise every tensor of a Llama GGUF file and read its tokenizer metadata."""
    try:
        import gguf
        from gguf.quants import dequantize
    except ImportError as exc:  # pragma: no cover - gguf is a runtime dependency
        raise ConvertError(f"reading GGUF needs the `gguf` package ({exc})") from None
    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ConvertError(f"{path}: not a readable GGUF file ({exc})") from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ConvertError(f"{path}: architecture {arch!r}; only dense llama GGUFs are supported")

    def need(key: str):  # type: ignore[no-untyped-def]
        v = _field(reader, f"llama.{key}")
        if v is None:
            raise ConvertError(f"{path}: missing metadata llama.{key}")
        return v

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    head_dim = hidden // n_heads
    rope_dim = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ConvertError(f"{path}: rope dimension {rope_dim} != head dim {head_dim}")
    weights: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            arr = np.array(data, dtype=np.float32)
        else:
            arr = np.asarray(dequantize(data, t.tensor_type), dtype=np.float32)
        shape = tuple(int(d) for d in reversed(t.shape))
        arr = np.ascontiguousarray(arr.reshape(shape))
        name = t.name
        if name == "token_embd.weight":
            weights["model.embed_tokens.weight"] = arr
        elif name == "output_norm.weight":
            weights["model.norm.weight"] = arr
        elif name == "output.weight":
            weights["lm_head.weight"] = arr
        elif name.startswith("blk."):
            _, layer, kind, _ = name.split(".", 3)
            if kind not in _GGUF_TO_HF:
                continue  # e.g. rope_freqs: not used by this model family
            if kind == "attn_q":
                arr = reverse_permute(arr, n_heads)
            elif kind == "attn_k":
                arr = reverse_permute(arr, n_kv)
            weights[f"model.layers.{layer}.{_GGUF_TO_HF[kind]}.weight"] = arr
    tokens = [str(x) for x in _field(reader, "tokenizer.ggml.tokens", [])]
    if _field(reader, "tokenizer.ggml.model") != "gpt2" or not tokens:
        raise ConvertError(f"{path}: needs a byte-level BPE (gpt2) tokenizer in the metadata")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return DenseLlama(
        hidden=hidden,
        intermediate=int(need("feed_forward_length")),
        n_layers=int(need("block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab=len(tokens),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(need("attention.layer_norm_rms_epsilon")),
        context=int(_field(reader, "llama.context_length", 2048)),
        weights=weights,
        tokens=tokens,
        token_types=[int(x) for x in _field(reader, "tokenizer.ggml.token_type", [])],
        merges=[str(x) for x in _field(reader, "tokenizer.ggml.merges", [])],
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
        chat_template=_field(reader, "tokenizer.chat_template"),
        meta={
            "name": _field(reader, "general.name"),
            "license": _field(reader, "general.license"),
            "pre": _field(reader, "tokenizer.ggml.pre"),
        },
    )


def build_tokenizer_json(model: DenseLlama) -> str:
    """A ``tokenizers`` tokenizer.json for the GGUF's byte-level BPE (deterministic text)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(model.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in model.merges]
    tok = Tokenizer(
        models.BPE(
            vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=False
        )
    )
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]
    if model.meta.get("pre") == "smollm":
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=True, trim_offsets=False, use_regex=True
    )
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(model.tokens, model.token_types, strict=False)
        if ty == CONTROL
    ]
    if special:
        tok.add_special_tokens(special)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(model.tokens, model.token_types, strict=False)
        if ty == USER_DEFINED
    ]
    if user:
        tok.add_tokens(user)
    # Round-trip through json for a stable, compact text form.
    return json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=1) + "\n"
