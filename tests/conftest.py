"""Repository-wide pytest configuration and the shared oracle-checkpoint fixture."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

# Make the oracle helpers (tests/oracle/tiny_models.py) importable from any test:
# `import tiny_models`.
_ORACLE = str(Path(__file__).resolve().parent / "oracle")
if _ORACLE not in sys.path:
    sys.path.insert(0, _ORACLE)

import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def oracle_checkpoint(tmp_path_factory):
    """Factory: ``oracle_checkpoint(arch, dtype="f32", **kw) -> tiny_models.OracleReference``.

    Plain builds (no expert_transform / expert_container / config_overrides) are cached for the
    session; custom builds get a fresh directory each call. ``ref.out_dir`` is the checkpoint
    folder; treat it as read-only.
    """
    cache: dict = {}

    def get(
        arch: str,
        dtype: str = "f32",
        *,
        seed: int | None = None,
        with_mtp: bool = True,
        expert_transform=None,
        expert_container=None,
        config_overrides=None,
    ) -> tiny_models.OracleReference:
        custom = expert_transform is not None or expert_container is not None or config_overrides
        key = (arch, dtype, seed, with_mtp)
        if not custom and key in cache:
            return cache[key]
        out = tmp_path_factory.mktemp(f"oracle-{arch}-{dtype}")
        ref = tiny_models.build_checkpoint(
            arch,
            out,
            dtype=dtype,
            seed=seed,
            with_mtp=with_mtp,
            expert_transform=expert_transform,
            expert_container=expert_container,
            config_overrides=config_overrides,
        )
        if not custom:
            cache[key] = ref
        return ref

    return get


GLM_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think></think>{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model(oracle_checkpoint, tmp_path_factory) -> Path:
    """The tiny GLM-4 checkpoint plus a byte-level BPE tokenizer and a GLM-style template
    (shared by the generate CLI and the daemon tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    ref = oracle_checkpoint("glm4_moe")
    model = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(ref.out_dir, model)
    specials = [
        "<|endoftext|>",
        "[gMASK]",
        "<sop>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<think>",
        "</think>",
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["What is the capital of France? Paris, café, 🙂 naïve."] * 50, trainer)
    assert tok.get_vocab_size() <= json.loads((model / "config.json").read_text())["vocab_size"]
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": GLM_TEMPLATE, "eos_token": "<|endoftext|>"})
    )
    return model
