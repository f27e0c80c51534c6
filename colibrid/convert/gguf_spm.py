"""A SentencePiece-style tokenizer (Llama's, Mixtral's) as llama.cpp's ``llama`` vocabulary.

Hugging Face ships these tokenizers as a ``tokenizer.json`` whose model is a BPE with
``byte_fallback`` (characters outside the vocabulary become the byte tokens
``<0x00>``..``<0xFF>``) and whose spaces are written as "▁" (a normalizer replacing " ",
or a Metaspace pre-tokenizer). llama.cpp tokenises them with its own SentencePiece
algorithm: it repeatedly joins the adjacent pair whose concatenation is the vocabulary
token with the highest *score*, leftmost first on ties. Hugging Face's BPE instead
applies the merge with the lowest *rank*. Each token is scored by minus the rank of the
first merge that produces it, so llama.cpp joins pairs in the merges' order. A
``tokenizer.json`` converted from a SentencePiece model (Llama, Mixtral) lists every pair
that forms a token, in the order of the original scores, so the two agree at every step.
A BPE trained as BPE makes each token by one merge only; llama.cpp may also join another
split of the same token there (rare, not ruled out). Without a ``tokenizer.model`` the
merges are the information there is: llama.cpp's own converter gives every token the same
score, which joins pairs leftmost first and cuts differently.

Why the checks: a tokenizer llama.cpp would cut differently must not export silently.

* Whitespace: exactly one of the two "▁" forms, and nothing else that rewrites text;
  llama.cpp's ``add_space_prefix`` follows whether a "▁" is put before the text (where a
  Metaspace's prefix differs from llama.cpp's, the export's note says so). A
  Metaspace that also *splits* at "▁" is exported only when no token has a "▁" past its
  first character (then no token can span a split, and splitting changes nothing).
* The 256 byte tokens must all be there: llama.cpp's byte fallback has no ``<unk>`` to
  fall back to.

Token types: the model's ``unk_token`` UNKNOWN, added special tokens CONTROL (never split,
parsed in chat templates), other added tokens USER_DEFINED, the byte tokens BYTE, the rest
NORMAL; ids past the tokenizer up to the model's vocabulary are UNUSED padding.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from colibrid.errors import ConvertError

SPACE = "▁"  # SentencePiece's visible space, U+2581
_BYTE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def is_sentencepiece_style(tokenizer: dict) -> bool:
    """A BPE with byte fallback: how Hugging Face stores a SentencePiece BPE model."""
    model = tokenizer.get("model") or {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def _parts(step: Any, sequence_key: str) -> list[dict]:
    """A normalizer or pre-tokenizer as its list of steps (a Sequence flattened)."""
    if not isinstance(step, dict):
        return []
    if step.get("type") == "Sequence":
        return [p for s in step.get(sequence_key, []) for p in _parts(s, sequence_key)]
    return [step]


def _normalizer_space(path: Path, normalizer: Any) -> tuple[bool, bool]:
    """(spaces become "▁", a "▁" goes before the text) from the legacy normalizer form."""
    replaces = prepends = False
    for step in _parts(normalizer, "normalizers"):
        kind = step.get("type")
        if kind == "Prepend" and step.get("prepend") == SPACE:
            prepends = True
        elif (
            kind == "Replace"
            and (step.get("pattern") or {}).get("String") == " "
            and step.get("content") == SPACE
        ):
            replaces = True
        else:
            raise ConvertError(
                f"{path}: normalizer step {json.dumps(step)[:80]} rewrites text as llama.cpp's "
                "SentencePiece tokenizer does not; --no-tokenizer exports token ids only"
            )
    return replaces, prepends


def _metaspace(path: Path, pre: Any, vocab: dict[str, int]) -> tuple[bool, str]:
    """(spaces become "▁", its prepend scheme) from a Metaspace pre-tokenizer."""
    steps = _parts(pre, "pretokenizers")
    if not steps:
        return False, "never"
    if len(steps) > 1 or steps[0].get("type") != "Metaspace":
        raise ConvertError(
            f"{path}: pre-tokenizer {json.dumps(pre)[:80]} cuts text where llama.cpp's "
            "SentencePiece tokenizer does not; --no-tokenizer exports token ids only"
        )
    step = steps[0]
    if step.get("replacement", SPACE) != SPACE:
        raise ConvertError(f"{path}: Metaspace replacement {step.get('replacement')!r} is not '▁'")
    if step.get("split", True):
        spanning = next((t for t in vocab if SPACE in t[1:]), None)
        if spanning is not None:
            raise ConvertError(
                f"{path}: its Metaspace splits at '▁' but token {spanning!r} spans a split, "
                "which llama.cpp would form; --no-tokenizer exports token ids only"
            )
    scheme = step.get("prepend_scheme")
    if scheme is None:  # the form before prepend_scheme existed
        scheme = "always" if step.get("add_prefix_space", True) else "never"
    return True, str(scheme)


def space_prefix(path: Path, tokenizer: dict) -> tuple[bool, str]:
    """Whether the tokenizer puts a "▁" before the text (llama.cpp's add_space_prefix),
    and where llama.cpp's prefix differs from it ("" when nowhere); ConvertError when its
    whitespace handling is not SentencePiece's.

    llama.cpp prefixes every text, and every text after a special token, with "▁", as the
    legacy normalizer does. A Metaspace skips the prefix on text that already starts with
    a space, and with the scheme "first" after special tokens too; no GGUF key says so."""
    vocab = tokenizer["model"].get("vocab") or {}
    replaces, prepends = _normalizer_space(path, tokenizer.get("normalizer"))
    metaspace, scheme = _metaspace(path, tokenizer.get("pre_tokenizer"), vocab)
    if replaces == metaspace:
        how = "both a normalizer and a Metaspace" if replaces else "neither"
        raise ConvertError(
            f"{path}: spaces become '▁' through {how}, not the one SentencePiece form "
            "llama.cpp reproduces; --no-tokenizer exports token ids only"
        )
    if replaces:
        return prepends, ""
    if scheme == "never":
        return False, ""
    after = " or follows a special token" if scheme == "first" else ""
    return True, f"llama.cpp adds one more leading space to text that starts with a space{after}"


def _merge_results(merges: list) -> list[str]:
    """The token each merge makes, in rank order (merges as "a b" or as [a, b])."""
    out = []
    for m in merges:
        if isinstance(m, str):
            left, _, right = m.partition(" ")
        else:
            left, right = m
        out.append(left + right)
    return out


def vocabulary(
    path: Path, tokenizer: dict, n_vocab: int
) -> tuple[list[str], list[float], list[int]]:
    """Tokens by id, their scores and their llama.cpp token types, padded to ``n_vocab``."""
    import gguf

    model = tokenizer["model"]
    vocab: dict[str, int] = {str(t): int(i) for t, i in (model.get("vocab") or {}).items()}
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:
        raise ConvertError(
            f"{path}: byte fallback without {len(missing)} of the byte tokens "
            f"(first: {missing[0]}); llama.cpp needs all 256"
        )
    merges = model.get("merges") or []
    floor = -float(len(merges) + 1)  # below every merge: only formed when nothing else is
    score: dict[str, float] = {}
    for rank, text in enumerate(_merge_results(merges)):
        score.setdefault(text, -float(rank))
    unk = model.get("unk_token")
    by_id: dict[int, tuple[str, int]] = {}
    for text, i in vocab.items():
        if text == unk:
            kind = gguf.TokenType.UNKNOWN
        elif _BYTE.fullmatch(text):
            kind = gguf.TokenType.BYTE
        else:
            kind = gguf.TokenType.NORMAL
        by_id[i] = (text, kind)
    for added in tokenizer.get("added_tokens") or []:
        text = added["content"]
        if text == unk:
            kind = gguf.TokenType.UNKNOWN
        elif added.get("special"):
            kind = gguf.TokenType.CONTROL
        else:
            kind = gguf.TokenType.USER_DEFINED
        by_id[int(added["id"])] = (text, kind)
    if by_id and max(by_id) >= n_vocab:
        raise ConvertError(
            f"tokenizer.json has token id {max(by_id)}, beyond the model's vocabulary {n_vocab}"
        )
    tokens, scores, types = [], [], []
    for i in range(n_vocab):
        text, kind = by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED))
        tokens.append(text)
        scores.append(score.get(text, floor) if kind == gguf.TokenType.NORMAL else floor)
        types.append(int(kind))
    return tokens, scores, types


def add_sentencepiece(w: Any, folder: Path, tokenizer: dict, n_vocab: int) -> str:
    """Write ``tokenizer.json`` (already parsed, SentencePiece-style) into the GGUF writer
    ``w`` as llama.cpp's ``llama`` vocabulary; returns the line saying what was written."""
    import gguf

    path = folder / "tokenizer.json"
    prefix, caveat = space_prefix(path, tokenizer)
    tokens, scores, types = vocabulary(path, tokenizer, n_vocab)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_add_space_prefix(prefix)
    special = gguf.SpecialVocab(folder, load_merges=False, n_vocab=n_vocab)
    special.add_to_gguf(w, quiet=True)
    template = "with" if special.chat_template else "without"
    line = f"tokenizer: SentencePiece-style BPE (byte fallback), {template} chat template"
    return f"{line} ({caveat})" if caveat else line
