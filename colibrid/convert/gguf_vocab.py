"""The container's tokenizer and chat template as GGUF ``tokenizer.*`` keys.

A SentencePiece-style tokenizer (a BPE with byte fallback: Llama's, Mixtral's) goes to
:mod:`colibrid.convert.gguf_spm`; this module writes the byte-level BPE ones.

Why these rules: llama.cpp tokenises with its own implementation of a byte-level BPE
("gpt2" model): the vocabulary by id, each token's type, the merges, and a named
pre-tokeniser (the regex that cuts text before BPE) that it must know by name. The names
are chosen from what the tokenizer.json declares, as llama.cpp's converter does for the
same tokenizers: the pre-tokeniser's regexes (or GPT-2's, where the byte-level step splits
on its own) are looked up in :data:`PRE_TOKENIZERS`; a pre-tokeniser llama.cpp has no name
for is refused unless the user names one (``--tokenizer-pre``), since a wrong regex would
tokenise differently without any error.

* Token types: added tokens marked special are CONTROL (so llama.cpp parses them in a chat
  template and never splits them), other added tokens USER_DEFINED, the rest NORMAL; ids
  between the tokenizer's size and the model's vocabulary are UNUSED padding.
* bos/eos/pad ids, ``add_bos_token``, the merges and the chat template come through
  gguf-py's ``SpecialVocab`` (tokenizer.json, tokenizer_config.json, chat_template.jinja).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from colibrid.convert.gguf_spm import add_sentencepiece, is_sentencepiece_style
from colibrid.errors import ConvertError

GPT2_REGEX = "gpt2-bytelevel"  # a ByteLevel pre-tokeniser that splits with GPT-2's regex
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
    r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# (the pre-tokeniser's steps) -> llama.cpp's name for it; per family where llama.cpp
# gives one regex several names with different special-token rules.
PRE_TOKENIZERS: dict[tuple[str, ...], str] = {
    (GPT2_REGEX,): "gpt-2",
    ("digits", GPT2_REGEX): "smollm",
    (QWEN2,): "qwen2",
    (LLAMA3,): "llama-bpe",
    (GPT4O,): "gpt-4o",
    DEEPSEEK3: "deepseek-v3",
}
FAMILY_PRE = {
    ("olmoe", "gpt-2"): "olmo",
    ("glm4_moe", "llama-bpe"): "glm4",
    ("glm_moe_dsa", "llama-bpe"): "glm4",
}


def _steps(pre: Any) -> tuple[str, ...]:
    """The pre-tokeniser as the steps that decide where text is cut."""
    if not isinstance(pre, dict):
        return ()
    kind = pre.get("type")
    if kind == "Sequence":
        return tuple(s for p in pre.get("pretokenizers", []) for s in _steps(p))
    if kind == "Split":
        pattern = pre.get("pattern") or {}
        return (str(pattern.get("Regex", pattern.get("String", ""))),)
    if kind == "ByteLevel":
        return (GPT2_REGEX,) if pre.get("use_regex", True) else ()
    if kind == "Digits":
        return ("digits",) if pre.get("individual_digits") else ("digits-grouped",)
    return (f"<{kind}>",)


def pre_tokenizer_name(tokenizer: dict, model_type: str) -> str | None:
    """llama.cpp's name for the tokenizer's pre-tokeniser, or None when it has none."""
    name = PRE_TOKENIZERS.get(_steps(tokenizer.get("pre_tokenizer")))
    if name is None:
        return None
    return FAMILY_PRE.get((model_type, name), name)


def _tokens(tokenizer: dict, n_vocab: int) -> tuple[list[str], list[int]]:
    import gguf

    model = tokenizer["model"]
    by_id: dict[int, tuple[str, int]] = {
        int(i): (t, gguf.TokenType.NORMAL) for t, i in model["vocab"].items()
    }
    for added in tokenizer.get("added_tokens") or []:
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        by_id[int(added["id"])] = (added["content"], kind)
    if by_id and max(by_id) >= n_vocab:
        raise ConvertError(
            f"tokenizer.json has token id {max(by_id)}, beyond the model's vocabulary {n_vocab}"
        )
    tokens, types = [], []
    for i in range(n_vocab):
        text, kind = by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED))
        tokens.append(text)
        types.append(int(kind))
    return tokens, types


def add_tokenizer(w: Any, folder: Path, cfg: dict, pre: str | None) -> str:
    """Write the tokenizer keys of ``folder`` into the GGUF writer ``w``; returns a line
    saying what was written (or why not: a folder without tokenizer.json gets ids only)."""
    import gguf

    n_vocab = int(cfg["vocab_size"])
    path = folder / "tokenizer.json"
    if not path.is_file():
        w.add_tokenizer_model("none")
        return "no tokenizer.json: the GGUF takes token ids only"
    try:
        tokenizer = json.loads(path.read_text(encoding="utf-8"))
        model = tokenizer["model"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConvertError(f"{path}: unreadable tokenizer ({exc})") from None
    if is_sentencepiece_style(tokenizer):
        if pre is not None:
            raise ConvertError(
                f"--tokenizer-pre {pre!r}: {path} is a SentencePiece-style tokenizer, which "
                "llama.cpp cuts without a named pre-tokenizer; leave it out"
            )
        return add_sentencepiece(w, folder, tokenizer, n_vocab)
    decoder = (tokenizer.get("decoder") or {}).get("type")
    if model.get("type") != "BPE" or decoder != "ByteLevel":
        raise ConvertError(
            f"{path}: only byte-level BPE and SentencePiece-style (byte-fallback BPE) "
            f"tokenizers are exported (this one: {model.get('type')}, decoder {decoder}); "
            "--no-tokenizer exports token ids only"
        )
    name = pre or pre_tokenizer_name(tokenizer, str(cfg.get("model_type")))
    if name is None:
        raise ConvertError(
            f"{path}: its pre-tokenizer is not one llama.cpp names "
            f"({json.dumps(tokenizer.get('pre_tokenizer'))[:80]}...); name it with "
            f"--tokenizer-pre (known: {', '.join(sorted(set(PRE_TOKENIZERS.values())))})"
        )
    tokens, types = _tokens(tokenizer, n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(name)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
    special.add_to_gguf(w, quiet=True)
    template = "with" if special.chat_template else "without"
    return f"tokenizer: byte-level BPE, pre-tokenizer {name!r}, {template} chat template"
