"""`colibrid generate` end to end: the real command on real checkpoints built at test time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models

from colibrid.engine.tokenizer import TextCodec


def run_generate(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibrid", "generate", *args],
        capture_output=True,
        text=True,
        timeout=300,
        input=stdin,
    )


@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_ids_out_matches_transformers_without_tokenizer(oracle_checkpoint, arch: str) -> None:
    ref = oracle_checkpoint(arch)
    assert not (ref.out_dir / "tokenizer.json").exists()
    result = run_generate(
        "--model",
        str(ref.out_dir),
        "--ids",
        ",".join(map(str, ref.prompt_ids)),
        "--ids-out",
        "--max-tokens",
        "20",
    )
    assert result.returncode == 0, result.stderr
    assert [int(t) for t in result.stdout.strip().split(",")] == ref.greedy_ids
    assert "12 prompt" in result.stderr and "20 generated" in result.stderr


def test_prompt_is_rendered_generated_and_detokenised(chat_model: Path) -> None:
    codec = TextCodec.load(chat_model)
    prompt_ids = codec.encode_chat([{"role": "user", "content": "What is the capital?"}])
    assert prompt_ids[:2] == [codec.token_to_id("[gMASK]"), codec.token_to_id("<sop>")]
    by_ids = run_generate(
        "--model",
        str(chat_model),
        "--ids",
        ",".join(map(str, prompt_ids)),
        "--ids-out",
        "--max-tokens",
        "12",
    )
    by_text = run_generate(
        "--model", str(chat_model), "--prompt", "What is the capital?", "--max-tokens", "12"
    )
    assert by_ids.returncode == 0 and by_text.returncode == 0, by_text.stderr
    ids = [int(t) for t in by_ids.stdout.strip().split(",")]
    stops = codec.stop_token_ids
    kept = ids[: next((i for i, t in enumerate(ids) if t in stops), len(ids))]
    assert by_text.stdout.rstrip("\n") == codec.decode(kept)
    assert "tok/s" in by_text.stderr


def test_stdin_prompt_and_seeded_sampling(chat_model: Path) -> None:
    args = (
        "--model",
        str(chat_model),
        "--temperature",
        "1.5",
        "--top-p",
        "0.9",
        "--seed",
        "7",
        "--max-tokens",
        "16",
    )
    first = run_generate(*args, stdin="Tell me about Paris")
    second = run_generate(*args, stdin="Tell me about Paris")
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.strip()


def test_system_raw_stop_and_i8_family(chat_model: Path) -> None:
    """--system goes into the template; --raw skips it; -v adds detail; i8 runs (lossy)."""
    chat = run_generate(
        "--model",
        str(chat_model),
        "--prompt",
        "hi",
        "--system",
        "be brief",
        "--max-tokens",
        "4",
        "-v",
    )
    assert chat.returncode == 0, chat.stderr
    assert "decode" in chat.stderr
    raw = run_generate(
        "--model",
        str(chat_model),
        "--raw",
        "--max-tokens",
        "8",
        "--kernel-family",
        "i8",
        stdin="café Paris",
    )
    assert raw.returncode == 0, raw.stderr
    full = run_generate(
        "--model", str(chat_model), "--raw", "--max-tokens", "8", stdin="café Paris"
    )
    text = full.stdout.rstrip("\n")
    if len(text) > 2:
        stop = text[1:3]
        cut = run_generate(
            "--model",
            str(chat_model),
            "--raw",
            "--max-tokens",
            "8",
            "--stop",
            stop,
            stdin="café Paris",
        )
        assert cut.stdout.rstrip("\n") == text[: text.index(stop)]
        assert "finish=stop" in cut.stderr


def test_out_of_vocabulary_id_is_one_line_error(oracle_checkpoint) -> None:
    result = run_generate(
        "--model", str(oracle_checkpoint("glm4_moe").out_dir), "--ids", "1,99999", "--ids-out"
    )
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("colibrid: error:")


def test_ctrl_c_exits_130_without_traceback(chat_model: Path) -> None:
    """Ctrl-C while the command waits for its prompt on stdin: exit 130, no traceback."""
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "colibrid", "generate", "--model", str(chat_model)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(2.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
