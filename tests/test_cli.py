"""`colibrid` argument handling and usage errors (before any model is loaded).

Generation itself is tested end to end, with the real engine on real checkpoints, in
tests/test_generate_cli.py.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from colibrid import cli

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
EOS = 256


def _byte_tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return tok


@pytest.fixture
def model(tmp_path: Path) -> Path:
    _byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE})
    )
    return tmp_path


@pytest.fixture
def bare_model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    return tmp_path


def ids_of(text: str) -> list[int]:
    return _byte_tokenizer().encode(text, add_special_tokens=False).ids


# ---- usage ------------------------------------------------------------------------------
def test_help_lists_generate(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0 and "generate" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, match",
    [
        ([], "required"),
        (["generate"], "--model"),
        (["generate", "--model", "m", "--ids", "1,x"], "comma-separated"),
        (["generate", "--model", "m", "--ids", "-1"], "non-negative"),
        (["generate", "--model", "m", "--ids", "1", "--prompt", "a"], "not allowed with"),
        (["generate", "--model", "m", "--prompt", "a", "--raw", "--system", "s"], "--system"),
        (["generate", "--model", "m", "--ids", "1", "--system", "s"], "--system"),
        (["generate", "--model", "m", "--prompt", "a", "--temperature", "-1"], "temperature"),
        (["generate", "--model", "m", "--prompt", "a", "--top-p", "0"], "top_p"),
        (["generate", "--model", "m", "--prompt", "a", "--max-tokens", "0"], "max_tokens"),
        (["generate", "--model", "m", "--prompt", "a", "--stop", ""], "non-empty"),
        (["generate", "--model", "m", "--prompt", "a", "--kernel-family", "f16"], "invalid choice"),
    ],
)
def test_bad_usage_exits_2(argv, match, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "colibrid" in err


def test_no_prompt_on_a_tty_is_usage_error(monkeypatch, capsys, model):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Tty())
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--model", str(model)])
    assert info.value.code == 2 and "pipe text on stdin" in capsys.readouterr().err


def test_missing_model_dir_is_one_line_error(tmp_path, capsys):
    assert cli.main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("colibrid: error: model ") and "nope" in err and err.count("\n") == 1


def test_missing_tokenizer_names_the_way_out(bare_model, capsys):
    assert cli.main(["generate", "--model", str(bare_model), "--prompt", "x"]) == 1
    assert "use --ids with --ids-out" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(bare_model), "--ids", "1,2"]) == 1
    assert "use --ids with --ids-out" in capsys.readouterr().err


# ---- generate on the fake engine --------------------------------------------------------
