"""Loading refuses bad models with one line naming the problem — never a crash or a hang."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from colibrid.engine.engine import Engine
from colibrid.errors import ColibriError
from colibrid.models import SUPPORTED, family


@pytest.fixture
def model_copy(oracle_checkpoint, tmp_path) -> Path:
    ref = oracle_checkpoint("glm4_moe")
    dst = tmp_path / "model"
    shutil.copytree(ref.out_dir, dst)
    return dst


def edit_config(model: Path, **changes) -> None:
    path = model / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def cli_generate(model: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "colibrid",
            "generate",
            "--model",
            str(model),
            "--ids",
            "1,2,3",
            "--ids-out",
            "--max-tokens",
            "2",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibrid: error:"), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"model_type": "llama"}, "llama"),
        ({"hidden_size": -64}, "hidden_size"),
        ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
        ({"vocab_size": "many"}, "vocab_size"),
        ({"n_routed_experts": 7}, "expected [7, 128]"),  # disagrees with the tensors on disk
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ],
)
def test_bad_config_is_refused_by_name(model_copy: Path, changes: dict, needle: str) -> None:
    edit_config(model_copy, **changes)
    with pytest.raises(ColibriError) as info:
        Engine.load(model_copy)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_cli_missing_model_dir(tmp_path: Path) -> None:
    assert_one_line_error(cli_generate(tmp_path / "nowhere"), "nowhere")


def test_cli_unknown_architecture(model_copy: Path) -> None:
    """One line naming the refused model_type and every supported one."""
    edit_config(model_copy, model_type="qwen2_moe")
    assert_one_line_error(cli_generate(model_copy), "'qwen2_moe'", *SUPPORTED)


def test_unknown_architecture_lists_the_new_families() -> None:
    with pytest.raises(ColibriError) as info:
        family("llama4")
    message = str(info.value)
    assert "\n" not in message and "'llama4'" in message
    for arch in SUPPORTED:
        assert arch in SUPPORTED and arch in message


def test_cli_truncated_weights(model_copy: Path) -> None:
    shard = max(model_copy.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    assert_one_line_error(cli_generate(model_copy), shard.name)


def test_cli_missing_tensor(model_copy: Path) -> None:
    index = json.loads((model_copy / "model.safetensors.index.json").read_text())
    # Point a tensor at a file that does not exist.
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "missing.safetensors"
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_one_line_error(cli_generate(model_copy), "missing.safetensors")


def test_context_limit_is_enforced(oracle_checkpoint) -> None:
    engine = Engine.load(oracle_checkpoint("glm4_moe").out_dir, max_context=8)
    session = engine.new_session()
    session.prefill([1, 2, 3, 4, 5, 6])
    with pytest.raises(ColibriError, match="context"):
        session.prefill([1, 2, 3])
    assert session.length == 6  # the refused call changed nothing
    engine.close()


def test_load_hands_the_backend_every_matrix_layout_before_the_first_token(model_copy):
    """Ops.prepare sees each layout the model holds (dense and experts) with its largest
    row count, once, before anything is computed: what the CPU backend calibrates."""
    from colibrid.backends.cpu import CpuOps

    calls: list[dict] = []

    class Recording(CpuOps):
        def prepare(self, layouts):  # noqa: ANN001
            calls.append(dict(layouts))
            super().prepare(layouts)

    config = json.loads((model_copy / "config.json").read_text())
    engine = Engine.load(model_copy, ops=Recording())
    try:
        assert len(calls) == 1
        (layouts,) = calls
        ins = {lay.in_features for lay in layouts}
        assert {config["hidden_size"], config["moe_intermediate_size"]} <= ins
        rows = max(o for lay, o in layouts.items() if lay.in_features == config["hidden_size"])
        assert rows >= config["intermediate_size"]  # a dense MLP gate at least
        assert layouts == engine.checkpoint.matrix_layouts
    finally:
        engine.close()
