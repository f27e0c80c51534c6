"""`colibri bench replay|policy|stream` end to end on a tiny real checkpoint: a recorded
workload replays token-exact through any placement, the policy table never beats
Belady, and the stream benchmark prints its figures against the probe it measured."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibrid.backends.cuda_device import EMULATE_ENV


def colibri(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri_cli", *args], capture_output=True, text=True, timeout=300
    )


def test_record_prompts_then_replay_through_a_tiny_cache(chat_model, tmp_path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# two requests\nhello there\n\nwhat is 2+2?\n")
    trace = tmp_path / "trace.json"
    rec = colibri(
        "bench",
        "replay",
        "--model",
        str(chat_model),
        "--record",
        str(trace),
        "--prompts",
        str(prompts),
        "--max-tokens",
        "6",
    )
    assert rec.returncode == 0, rec.stderr
    doc = json.loads(trace.read_text())
    assert len(doc["requests"]) == 2 and len(doc["prefill_steps"]) == 2
    assert doc["prefill_steps"][0] == 0 and doc["prefill_steps"][1] > 0
    assert all(1 <= len(r["generated_ids"]) <= 6 for r in doc["requests"])
    assert len(doc["trace"]) == sum(len(r["generated_ids"]) for r in doc["requests"])
    for cache in ("1", "2"):
        rep = colibri(
            "bench",
            "replay",
            "--replay",
            str(trace),
            "--cache",
            cache,
            "--pilot",
            "on",
            "--pin",
            "off",
        )
        assert rep.returncode == 0, rep.stdout + rep.stderr
        n = sum(len(r["generated_ids"]) for r in doc["requests"])
        assert f"2 request(s), {n} tokens teacher-forced" in rep.stdout
        assert f"argmax agrees {n}/{n}" in rep.stdout
        assert re.search(r"PILOT (on|off|auto: [^;]+); recall", rep.stdout)

    pol = colibri("bench", "policy", "--trace", str(trace), "--cache", "1", "--cache", "2")
    assert pol.returncode == 0, pol.stderr
    header, *rows = [line.split() for line in pol.stdout.splitlines()[:3]]
    names = header[1 : header.index("(default:")]
    assert names[-1] == "belady" and "lfru" in names and "lru" in names
    for row in rows:
        rates = dict(zip(names, (float(x.rstrip("%")) for x in row[1:]), strict=True))
        assert all(rates[n] <= rates["belady"] + 1e-9 for n in names)


@pytest.mark.parametrize("family", ["f32", "i8"])
def test_stream_reports_against_its_own_probe(oracle_checkpoint, family: str) -> None:
    ref = oracle_checkpoint("deepseek_v3")
    out = colibri(
        "bench",
        "stream",
        "--model",
        str(ref.out_dir),
        "--cache",
        "1",
        "--tokens",
        "4",
        "--warmup",
        "1",
        "--probe-reads",
        "8",
        "--family",
        family,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    probe = float(re.search(r"probe: .*: ([0-9.]+) GB/s", text).group(1))
    assert probe > 0
    assert re.search(r"decode: [0-9.]+ tok/s over 4 tokens; hit [0-9.]+%", text)
    assert re.search(r"roofline: [0-9.]+ tok/s .* achieved \d+% of it", text)
    assert re.search(r"stream: PILOT (on|off|auto: [^;]+); recall", text)
    assert f"kernel family: {family}" in text
    cache = re.search(r"cache: ([0-9.e+-]+) GB read/token; .* could read .*: ([0-9.e+-]+) ", text)
    assert cache and 0 <= float(cache.group(2)) <= float(cache.group(1)), text
    assert "vram:" not in text  # the cpu backend keeps no device tier


def test_stream_on_cuda_reports_the_device_tier(oracle_checkpoint, monkeypatch) -> None:
    """On the cuda backend (its kernels emulated here), beside the disk: the GPU's read and
    copy probes, and what the device tier served and copied a token."""
    monkeypatch.setenv(EMULATE_ENV, "1")
    ref = oracle_checkpoint("deepseek_v3")
    flags = ("--cache", "1", "--tokens", "4", "--warmup", "1", "--probe-reads", "8")
    out = colibri("bench", "stream", "--model", str(ref.out_dir), *flags, "--backend", "cuda")
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"read probe [0-9.]+ GB/s, host to device [0-9.]+ GB/s", out.stdout)
    tier = re.search(
        r"vram: [0-9.]+ GB held \(budget .*\); ([0-9.]+)% of weight uses served from it; "
        r"([0-9.]+) copies in \([0-9.]+ GB\) a token, ([0-9.]+) of them",
        out.stdout,
    )
    assert tier, out.stdout
    assert 0 < float(tier.group(1)) < 100 and float(tier.group(2)) > 0  # experts stream in


def test_record_needs_a_model(tmp_path: Path) -> None:
    out = colibri("bench", "replay", "--record", str(tmp_path / "t.json"))
    assert out.returncode == 2 and "--record needs --model" in out.stderr


def _decode_bytes_per_token(model: Path) -> int:
    """What one resident decode step must read, counted from the checkpoint alone: every
    matrix of the trunk's layers except the router (scored in numpy) and the routed
    experts, plus top-k experts per MoE layer, the output head and one embedding row."""
    from safetensors import safe_open

    config = json.loads((model / "config.json").read_text())
    layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
    total, expert_bytes, moe_layers = 0, 0, set()
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(path, "np") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                size = 4 * int(np.prod(shape))  # the tiny checkpoints are float32
                if name == "lm_head.weight":
                    total += size
                elif name == "model.embed_tokens.weight":
                    total += size // shape[0]
                match = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", name)
                if not match or int(match[1]) >= layers or len(shape) != 2:
                    continue
                if ".mlp.experts.0." in name:
                    expert_bytes += size
                    moe_layers.add(int(match[1]))
                elif ".mlp.experts." not in name and not name.endswith(".mlp.gate.weight"):
                    total += size
    return total + top_k * expert_bytes


def test_decode_bench_counts_the_bytes_a_token_reads_and_its_roofline(chat_model) -> None:
    run = colibri(
        "bench", "decode", "--model", str(chat_model), "--prompt-tokens", "8", "--tokens", "4",
        "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)
    assert r["weight_gb_per_token"] * 1e9 == pytest.approx(_decode_bytes_per_token(chat_model))
    assert r["membw_gbs"] > 0 and r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
    assert r["roofline_tok_s"] == pytest.approx(r["membw_gbs"] / r["weight_gb_per_token"])
    assert r["ratio"] == pytest.approx(r["decode_tok_s"] / r["roofline_tok_s"])
    assert r["kernel_floor_tok_s"] > 0
    assert r["floor_ratio"] == pytest.approx(r["decode_tok_s"] / r["kernel_floor_tok_s"])
    assert r["kv_mb_per_token"] > 0
    text = colibri("bench", "decode", "--model", str(chat_model), "--prompt-tokens", "8")
    assert text.returncode == 0, text.stderr
    assert re.search(r"roofline: [\d.]+ tok/s .* decode is \d+% of it", text.stdout)
    limits = r"kernel floor: [\d.]+ tok/s .* the lower limit: (memory|kernel arithmetic)"
    assert re.search(limits, text.stdout)
    too_long = colibri("bench", "decode", "--model", str(chat_model), "--prompt-tokens", "250")
    assert too_long.returncode == 1
    assert "context is 256: lower them" in too_long.stderr and "Traceback" not in too_long.stderr


def test_batch_bench_answers_as_alone_and_reads_no_less_than_any_cache_could(chat_model) -> None:
    """`colibri bench batch` through a one-expert cache: every batched answer equals the
    same question alone, requests decoded together read fewer bytes per token than one
    alone, and no row claims fewer bytes than Belady's bound on its own routing."""
    run = colibri(
        "bench", "batch", "--model", str(chat_model), "--cache", "1", "--concurrency", "1,4",
        "--tokens", "6", "--pilot", "off", "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)
    assert r["probe_gb_s"] > 0
    rows = {row["requests"]: row for row in r["rows"]}
    assert sorted(rows) == [1, 4] and all(row["same_as_alone"] for row in rows.values())
    for row in rows.values():
        assert 0 <= row["fewest_gb_per_token"] <= row["gb_per_token"]
        assert row["roofline_tok_s"] == pytest.approx(r["probe_gb_s"] / row["gb_per_token"])
    assert rows[4]["gb_per_token"] < rows[1]["gb_per_token"]
    text = colibri(
        "bench", "batch", "--model", str(chat_model), "--cache", "1", "--concurrency", "1,2",
        "--tokens", "4",
    )  # fmt: skip
    assert text.returncode == 0, text.stderr
    bound = r"\(\d\.\d\dx the bytes of one alone; any cache of this size: >= \d\.\d\dx\)"
    assert re.search(bound, text.stdout)


def test_peer_bench_runs_both_runtimes_or_says_how_to_get_llama_cpp(demo_home) -> None:
    """`colibri bench peer` on the dense demo: with llama.cpp installed (the optional extra)
    both runtimes print their figures and the ratio; without it, one line saying how to
    install it, before any measuring. A missing dense model is one line naming the pull."""
    import importlib.util
    import os

    env = {**os.environ, "COLIBRI_HOME": str(demo_home)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "colibri_cli", *args],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )

    have_peer = importlib.util.find_spec("llama_cpp") is not None
    missing = run("bench", "peer", "--model", "demo-dense")
    assert missing.returncode == 1
    expected = "colibri pull demo --dense" if have_peer else "llama-cpp-python==0.3.36"
    assert expected in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    if not have_peer:
        return
    pulled = run("pull", "demo", "--dense", "--quiet")
    assert pulled.returncode == 0, pulled.stderr
    r = run("bench", "peer", "--prompt-tokens", "16", "--tokens", "8", "--pairs", "2", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["colibri"]["decode_tok_s"] > 0 and doc["peer"]["decode_tok_s"] > 0
    assert doc["colibri_i8"]["decode_tok_s"] > 0 and doc["decode_ratio_i8"] > 0
    assert doc["membw_gbs"] > 0 and doc["decode_ratio"] > 0 and len(doc["pairs"]) == 2
    summary = doc["summary"]
    assert summary["pairs"] == 2 and summary["isa"]
    assert 0.0 <= summary["pool_wait_share"]["median"] < 1.0
    assert summary["decode_ratio"]["min"] <= summary["decode_ratio"]["median"]
