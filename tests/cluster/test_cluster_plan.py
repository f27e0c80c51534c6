"""`colibri plan`: real probes on the demo, ceilings that follow from the figures it prints
(each naming its measurement), command lines that parse and agree with each other and
with the programs and commands they name, and one-line refusals."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from colibrid.cluster import launch
from colibrid.cluster.llama_build import cached


def plan(home: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri_cli", "plan", *args],
        env={**os.environ, "COLIBRI_HOME": str(home), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def figure(out: str, label: str) -> tuple[float, str]:
    """A `measured` row: its number and the measurement it names."""
    m = re.search(rf"^  {label}\s+([\d.]+) \S+\s+(.+)$", out, flags=re.M)
    assert m, f"no {label!r} row in:\n{out}"
    return float(m[1]), m[2]


def commands(out: str, section: str) -> list[tuple[str, list[str]]]:
    """(where, argv) of each command under `commands: SECTION`."""
    block = out.split(f"commands: {section}", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    steps, where = [], ""
    for line in block:
        if line.startswith("# "):
            where = line[2:]
        elif line:
            steps.append((where, shlex.split(line)))
    return steps


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_plan_measures_the_demo_and_prints_the_llama_cpp_cluster(demo_home: Path) -> None:
    r = plan(
        demo_home, "demo", "--hosts", "2", "--target-tok-s", "5", "--addresses",
        "10.0.0.1,10.0.0.2:50060",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = r.stdout
    memory, memory_src = figure(out, "memory")
    disk, disk_src = figure(out, "disk")
    token, token_src = figure(out, "a token reads")
    assert memory > 0 and "memory probe" in memory_src and "this run" in memory_src
    assert (
        disk > 0 and "disk probe" in disk_src and "O_DIRECT" in disk_src or "buffered" in disk_src
    )
    assert "safetensors headers" in token_src
    assert "auto budget" in figure(out, "RAM budget")[1]
    # the one-machine ceiling is the memory probe over the bytes a token reads (all resident)
    one = re.search(r"^one machine\s+ceiling ([\d.]+) tok/s, memory-bound", out, flags=re.M)
    assert one, out
    assert float(one[1]) == pytest.approx(memory / token, rel=0.02)
    assert re.search(r"^target\s+5 tok/s: one machine is enough", out, flags=re.M)

    steps = commands(out, "llama.cpp RPC")
    programs = [Path(argv[0]).name for _, argv in steps]
    assert programs == [
        "colibri", "colibri", "ggml-rpc-server", "ggml-rpc-server", "llama-server", "colibri",
    ]  # fmt: skip
    export, build, rpc1, rpc2, server, pull = (argv for _, argv in steps)
    assert export == ["colibri", "export", "demo", "--gguf", "demo.gguf"]
    assert build == ["colibri", "llama-build"]
    assert (flag(rpc1, "-H"), flag(rpc1, "-p")) == ("10.0.0.1", "50052")
    assert (flag(rpc2, "-H"), flag(rpc2, "-p")) == ("10.0.0.2", "50060")
    assert [w for w, _ in steps][2:4] == ["host 1", "host 2"]
    assert flag(server, "--rpc") == "10.0.0.1:50052,10.0.0.2:50060"
    assert flag(server, "-m") == "demo.gguf" and flag(server, "-ngl") == "all"
    assert flag(server, "--host") == "127.0.0.1"
    assert pull == [
        "colibri",
        "pull",
        f"http://127.0.0.1:{flag(server, '--port')}",
        "--name",
        "team",
    ]
    # the colibri lines name real commands and flags
    for argv in (export, build, pull):
        helped = subprocess.run(
            [sys.executable, "-m", "colibri_cli", argv[1], "--help"], capture_output=True, text=True
        )
        assert helped.returncode == 0, helped.stderr
        for f in (t for t in argv if t.startswith("--")):
            assert f in helped.stdout, f"colibri {argv[1]} has no {f}"


def test_the_llama_cpp_lines_use_flags_the_built_programs_have(demo_home: Path) -> None:
    found = cached()
    if found is None:
        pytest.skip("llama.cpp's RPC binaries are not built (`colibri llama-build`)")
    out = plan(demo_home, "demo", "--hosts", "2").stdout
    for _, argv in commands(out, "llama.cpp RPC"):
        name = Path(argv[0]).name
        if name == "colibri":
            continue
        exe = found.rpc_server if name == "ggml-rpc-server" else found.llama_server
        assert os.path.expanduser(argv[0]) == str(exe) or "COLIBRI_LLAMA_DIR" in os.environ
        helped = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
        text = helped.stdout + helped.stderr
        for f in (t for t in argv[1:] if t.startswith("-")):
            assert re.search(rf"(^|[\s,]){re.escape(f)}([\s,=]|$)", text, flags=re.M), (name, f)


def test_a_small_budget_streams_and_needs_more_hosts(demo_home: Path) -> None:
    r = plan(demo_home, "demo", "--hosts", "2", "--ram-gb", "0.3", "--target-tok-s", "1")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert figure(out, "RAM budget") == (0.3, "--ram-gb")
    disk = figure(out, "disk")[0]
    m = re.search(
        r"^one machine\s+ceiling ([\d.]+) tok/s, disk-bound: [\d.]+ GB/s \(disk probe\) / "
        r"([\d.]+) GB of experts a token from disk",
        out,
        flags=re.M,
    )
    assert m, out
    assert float(m[1]) == pytest.approx(disk / float(m[2]), rel=0.02)
    assert "2 hosts are not enough, 3 like this one are" in out


def test_gpu_nodes_get_vllm_and_sglang_expert_parallel(demo_home: Path) -> None:
    r = plan(
        demo_home, "demo", "--hosts", "2", "--gpus", "8", "--checkpoint", "zai-org/GLM-4.5-Air",
        "--addresses", "10.0.0.1,10.0.0.2",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "not measured (a Hugging Face repo id" in r.stdout
    (w1, v1), (w2, v2), (_, pull) = commands(r.stdout, "vLLM (expert parallel)")
    assert (w1, w2) == ("host 1", "host 2")
    for argv in (v1, v2):
        assert argv[:3] == ["vllm", "serve", "zai-org/GLM-4.5-Air"]
        assert "--enable-expert-parallel" in argv
        assert flag(argv, "--data-parallel-size") == "16"
        assert flag(argv, "--data-parallel-size-local") == "8"
        assert flag(argv, "--data-parallel-address") == "10.0.0.1"
    assert "--headless" not in v1 and "--data-parallel-start-rank" not in v1
    assert flag(v2, "--data-parallel-start-rank") == "8" and "--headless" in v2
    assert pull[-3:] == [f"http://127.0.0.1:{flag(v1, '--port')}", "--name", "team"]
    s1, s2, _ = (argv for _, argv in commands(r.stdout, "SGLang (expert parallel)"))
    for rank, argv in enumerate((s1, s2)):
        assert argv[:3] == ["python", "-m", "sglang.launch_server"]
        assert flag(argv, "--tp") == flag(argv, "--ep-size") == "16"
        assert flag(argv, "--nnodes") == "2" and flag(argv, "--node-rank") == str(rank)
        assert flag(argv, "--dist-init-addr") == f"10.0.0.1:{launch.SGLANG_INIT_PORT}"
    assert "--port" in s1 and "--port" not in s2


def test_an_original_checkpoint_is_what_gpu_engines_load(
    demo_home: Path, oracle_checkpoint
) -> None:
    folder = oracle_checkpoint("glm4_moe").out_dir
    r = plan(demo_home, str(folder), "--hosts", "1", "--gpus", "2")
    assert r.returncode == 0, r.stderr
    assert re.search(r"checkpoint \S+: [\d.]+ GB \(safetensors headers: \d+ files\)", r.stdout)
    ((_, serve), _) = commands(r.stdout, "vLLM (expert parallel)")
    assert serve[2] == str(folder.resolve()) and flag(serve, "--data-parallel-size") == "2"


def test_a_remote_model_is_refused(demo_home: Path, tmp_path: Path) -> None:
    from colibrid.remote.spec import REMOTE_FILE

    (tmp_path / REMOTE_FILE).write_text("{}")
    r = plan(demo_home, str(tmp_path), "--hosts", "2")
    assert r.returncode == 1 and "is a remote model" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["demo", "--hosts", "2", "--gpus", "8"], "--gpus needs --checkpoint DIR|REPO"),
        (["demo", "--hosts", "2", "--gpus", "8", "--checkpoint", "DEMO"], "is a colibri container"),
        (["demo", "--hosts", "2", "--gpus", "8", "--checkpoint", "no such"], "neither a folder"),
        (["demo", "--hosts", "3", "--addresses", "a,b"], "--addresses names 2 hosts"),
        (["demo", "--hosts", "2", "--addresses", "a,b:99999"], "has no valid port"),
        (["demo", "--hosts", "2", "--addresses", "a,a"], "share an address"),
        (["demo", "--hosts", "2", "--addresses", "a,-b"], "not a host name"),
        (["nonesuch", "--hosts", "2"], "neither a directory nor a model"),
        (["demo", "--hosts", "0"], "--hosts must be at least 1"),
        (["demo", "--hosts", "1"], "--hosts 1 without --gpus"),
        (["demo", "--hosts", "2", "--gpus", "0"], "--gpus must be at least 1"),
        (["demo", "--hosts", "2", "--target-tok-s", "0"], "--target-tok-s must be positive"),
        (["demo", "--hosts", "2", "--port", "0"], "--port must be a TCP port"),
        (["demo", "--hosts", "2", "--gpus", "1", "--gguf", "x.gguf"], "--gguf is for llama.cpp"),
        (["demo", "--hosts", "2", "--checkpoint", "a/b"], "--checkpoint goes with --gpus"),
        (["demo"], "--hosts"),
    ],
)
def test_refusals_are_one_line(demo_home: Path, args: list[str], message: str) -> None:
    args = [str(demo_home / "models" / "demo") if a == "DEMO" else a for a in args]
    r = plan(demo_home, *args)
    assert r.returncode in (1, 2)
    assert message in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(("colibri plan: error:", "usage:")) or (
        "error:" in r.stderr.strip().splitlines()[-1]
    )
    assert r.stdout == ""
