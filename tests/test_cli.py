"""`colibrid` argument handling, plus `generate` end to end on an injected fake engine.

The real engine is imported lazily as `colibrid.engine.engine.Engine`; the fake module put
in `sys.modules` under that name stands in for it, so these tests need no checkpoint.
"""

from __future__ import annotations

import io
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from colibrid import cli
from colibrid.errors import ModelLoadError

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
EOS = 256


class FakeSession:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine, self.ids = engine, []

    def _next(self) -> np.ndarray:
        out = np.zeros(self.engine.vocab_size, np.float32)
        pos = len(self.ids) - self.engine.prompt_len
        script = self.engine.script
        out[script[pos] if pos < len(script) else 0] = 1.0
        return out

    def prefill(self, token_ids, *, all_logits=False):
        self.engine.prompts.append(list(token_ids))
        self.engine.prompt_len = len(token_ids)
        self.ids.extend(token_ids)
        return self._next()

    def decode(self, token_id):
        if self.engine.interrupt_after is not None and len(self.ids) - self.engine.prompt_len \
                >= self.engine.interrupt_after:
            raise KeyboardInterrupt
        self.ids.append(token_id)
        return self._next()

    @property
    def length(self):
        return len(self.ids)


class FakeEngine:
    script: list[int] = []
    interrupt_after: int | None = None
    load_error: Exception | None = None
    loads: list[tuple[Path, object]] = []
    prompts: list[list[int]] = []

    def __init__(self) -> None:
        self.vocab_size, self.max_context, self.prompt_len = 257, 64, 0

    @classmethod
    def load(cls, model_dir, *, family):
        if cls.load_error is not None:
            raise cls.load_error
        cls.loads.append((Path(model_dir), family))
        return cls()

    def new_session(self) -> FakeSession:
        return FakeSession(self)


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> type[FakeEngine]:
    module = types.ModuleType("colibrid.engine.engine")

    class Engine(FakeEngine):
        script, loads, prompts = [], [], []

    module.Engine = Engine
    monkeypatch.setitem(sys.modules, "colibrid.engine.engine", module)
    return Engine


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
        json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE}))
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


@pytest.mark.parametrize("argv, match", [
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
])
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
    assert err.startswith("colibrid: error: model dir") and err.count("\n") == 1


def test_missing_tokenizer_names_the_way_out(bare_model, capsys):
    assert cli.main(["generate", "--model", str(bare_model), "--prompt", "x"]) == 1
    assert "use --ids with --ids-out" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(bare_model), "--ids", "1,2"]) == 1
    assert "use --ids with --ids-out" in capsys.readouterr().err


# ---- generate on the fake engine --------------------------------------------------------
def test_chat_prompt_streams_text(engine, model, capsys):
    engine.script = ids_of("Salut 🙂!") + [EOS]
    assert cli.main(["generate", "--model", str(model), "--prompt", "hi", "--system", "be"]) == 0
    out, err = capsys.readouterr()
    assert out == "Salut 🙂!\n"
    assert engine.prompts == [ids_of("<|system|>be<|user|>hi<|assistant|>")]
    assert err.startswith("colibri: ") and err.rstrip().endswith("finish=stop")
    assert f"prompt + {len(engine.script)} generated tokens" in err and err.count("\n") == 1
    assert engine.loads[0][1].value == "f32"


def test_raw_stdin_and_options(engine, model, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("été".encode())))
    engine.script = ids_of("abcdef")
    assert cli.main(["generate", "--model", str(model), "--raw", "--max-tokens", "4",
                     "--kernel-family", "i8", "--stop", "cd", "zz", "-v"]) == 0
    out, err = capsys.readouterr()
    assert out == "ab\n" and engine.prompts == [ids_of("été")]
    assert "finish=stop" in err and "raw prompt" in err and "decode" in err
    assert engine.loads[0][1].value == "i8"


def test_ids_in_ids_out_without_tokenizer(engine, bare_model, capsys):
    engine.script = [5, 7, 9, 11]
    assert cli.main(["generate", "--model", str(bare_model), "--ids", "1, 2,3", "--ids-out"]) == 0
    out, err = capsys.readouterr()
    assert out == "5,7,9\n" and "finish=stop" in err  # 9 is config.json's eos_token_id
    assert engine.prompts == [[1, 2, 3]]


def test_ids_out_length(engine, model, capsys):
    engine.script = [40, 41, 42, 43]
    assert cli.main(["generate", "--model", str(model), "--prompt", "x", "--ids-out",
                     "--max-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert out == "40,41\n" and "finish=length" in err


def test_engine_errors_and_interrupt(engine, model, capsys):
    engine.load_error = ModelLoadError("unknown architecture 'foo'")
    assert cli.main(["generate", "--model", str(model), "--prompt", "x"]) == 1
    assert capsys.readouterr().err == "colibrid: error: unknown architecture 'foo'\n"
    engine.load_error = None
    engine.script, engine.interrupt_after = ids_of("abcdef"), 2
    assert cli.main(["generate", "--model", str(model), "--prompt", "x"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_request_errors_exit_1(engine, model, capsys):
    assert cli.main(["generate", "--model", str(model), "--ids", "999"]) == 1
    assert "outside the vocabulary" in capsys.readouterr().err
