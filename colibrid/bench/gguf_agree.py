"""`colibri bench gguf`: does a GGUF written by `colibri export` compute what colibri does?

Method: a fixed set of chat prompts (the README's question first), each rendered by the
model's own chat template and tokenised by colibri; colibri (the container, f32 kernels)
and llama.cpp (the GGUF) each decode greedily from the same ids for ``--tokens`` steps,
every step from its own previous token. Agreement is counted per prompt as the length of
the common prefix of the two continuations (after the first difference the contexts
differ, so later tokens say nothing about the export), and in total as tokens agreeing
before the first difference out of the tokens decoded. Because one near-tie ends a
prefix, llama.cpp is also run teacher-forced on colibri's continuation: its top-1 at every
position against colibri's token there. The tokenizer is checked too:
llama.cpp's tokenisation of each prompt (special tokens parsed) against colibri's.
llama.cpp comes from the optional extra `colibri[peer]`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from colibrid.bench.llama_peer import last_logits, llama_cpp_module

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU cache is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Name a famous painting by Leonardo da Vinci.",
    "Give one tip for writing clean Python code.",
)


def colibri_greedy(
    model: Path, prompts: list[list[int]], tokens: int, family: str = "f32"
) -> list[list[int]]:
    from colibrid.backends.base import KernelFamily
    from colibrid.engine.engine import Engine

    engine = Engine.load(model, family=KernelFamily(family))
    try:
        out = []
        for ids in prompts:
            session = engine.new_session()
            logits, got = session.prefill(ids), []
            for _ in range(tokens):
                got.append(int(np.argmax(logits)))
                logits = session.decode(got[-1])
            out.append(got)
        return out
    finally:
        engine.close()


def llama_greedy(gguf: Path, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    llama_cpp = llama_cpp_module()
    n_ctx = max(len(p) for p in prompts) + tokens + 8
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, verbose=False)
    try:
        out = []
        for ids in prompts:
            llm.reset()
            llm.eval(ids)
            got = []
            for _ in range(tokens):
                got.append(int(np.argmax(last_logits(llm))))
                llm.eval([got[-1]])
            out.append(got)
        return out
    finally:
        llm.close()


def llama_teacher_forced(
    gguf: Path, prompts: list[list[int]], continuations: list[list[int]]
) -> list[list[int]]:
    """llama.cpp's top-1 after each prefix of prompt + continuation (one forward each)."""
    llama_cpp = llama_cpp_module()
    n_ctx = max(len(p) + len(c) for p, c in zip(prompts, continuations, strict=True)) + 8
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, logits_all=True, verbose=False)
    try:
        out = []
        for ids, cont in zip(prompts, continuations, strict=True):
            llm.reset()
            llm.eval(ids + cont[:-1])
            scores = np.asarray(llm.scores[len(ids) - 1 : len(ids) - 1 + len(cont)])
            out.append([int(t) for t in np.argmax(scores, axis=1)])
        return out
    finally:
        llm.close()


def llama_tokenize(gguf: Path, texts: Sequence[str]) -> list[list[int]]:
    """llama.cpp's ids of each text, special tokens parsed, nothing added."""
    llama_cpp = llama_cpp_module()
    llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    try:
        return [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]
    finally:
        llm.close()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run(model: Path, gguf: Path, n_prompts: int, tokens: int, family: str = "f32") -> dict:
    from colibrid.engine.tokenizer import TextCodec

    codec = TextCodec.load(model)
    texts = [codec.render_chat([{"role": "user", "content": p}]) for p in PROMPTS[:n_prompts]]
    ids = [codec.encode(t, add_special_tokens=False) for t in texts]
    theirs_ids = llama_tokenize(gguf, texts)
    ours = colibri_greedy(model, ids, tokens, family)
    theirs = llama_greedy(gguf, ids, tokens)
    agree = [common_prefix(a, b) for a, b in zip(ours, theirs, strict=True)]
    forced = llama_teacher_forced(gguf, ids, ours)
    tf_agree = sum(
        x == y for a, b in zip(ours, forced, strict=True) for x, y in zip(a, b, strict=True)
    )
    return {
        "model": str(model),
        "gguf": str(gguf),
        "family": family,
        "prompts": len(ids),
        "tokens_per_prompt": tokens,
        "tokenizer_equal": sum(a == b for a, b in zip(ids, theirs_ids, strict=True)),
        "agree_prefix": agree,
        "agree_tokens": sum(agree),
        "decoded_tokens": tokens * len(ids),
        "identical_prompts": sum(a == tokens for a in agree),
        "teacher_forced_agree": tf_agree,
        "colibri": ours,
        "llama_cpp": theirs,
    }


def report(r: dict) -> str:
    return "\n".join(
        [
            f"{r['gguf']} vs {r['model']}: {r['prompts']} chat prompts, "
            f"{r['tokens_per_prompt']} greedy tokens each",
            f"tokenizer: llama.cpp's ids equal colibri's on {r['tokenizer_equal']}/{r['prompts']}",
            f"greedy: {r['identical_prompts']}/{r['prompts']} continuations identical; "
            f"{r['agree_tokens']}/{r['decoded_tokens']} tokens agree before the first "
            f"difference (per prompt: {' '.join(map(str, r['agree_prefix']))})",
            f"teacher-forced on colibri's continuations: llama.cpp's top-1 agrees at "
            f"{r['teacher_forced_agree']}/{r['decoded_tokens']} positions",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri bench gguf", description=__doc__)
    p.add_argument("--model", default="demo", metavar="NAME|DIR", help="colibri model")
    p.add_argument("--gguf", required=True, metavar="FILE", help="its `colibri export` GGUF")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many prompts (max 8)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument(
        "--family",
        choices=("f32", "i8"),
        default="f32",
        help="colibri's kernel family: i8 turns activations into int8 as llama.cpp's "
        "Q4_0/Q8_0 products do (each in its own blocks), f32 keeps them float (default)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if not 1 <= a.prompts <= len(PROMPTS) or a.tokens < 1:
        p.error(f"--prompts must be 1..{len(PROMPTS)} and --tokens >= 1")
    from colibrid.config import resolve_model
    from colibrid.errors import ConfigError
    from colibrid.paths import Paths

    llama_cpp_module()
    gguf = Path(a.gguf)
    if not gguf.is_file():
        raise ConfigError(f"{gguf}: no such GGUF (write it with `colibri export MODEL --gguf`)")
    r = run(resolve_model(Paths.from_env(None), a.model), gguf, a.prompts, a.tokens, a.family)
    print(json.dumps(r) if a.json else report(r))
    return 0
