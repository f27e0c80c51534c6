"""A real llama.cpp RPC cluster on this machine, started from the lines `colibri plan`
prints: two `ggml-rpc-server` processes on loopback ports and one `llama-server --rpc`,
built by `colibri llama-build` from the llama-cpp-python sdist's llama.cpp, serving the
demo exported by `colibri export --gguf`. Its greedy answer to the README's question
equals llama.cpp's own single-process run of the same GGUF, and the same text arrives
through colibri in front: `colibri ask --model team` and the daemon's OpenAI endpoint.

The binaries take minutes to build on two cores: `.ci/run` builds them before pytest
(`colibri llama-build`), and the fixture below reuses that cache (or builds it once).
Without cmake or a C++ compiler the module skips, saying which is missing.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_helpers import free_port, start_http
from helpers.llama_server import Process, llama_binaries, wait_healthy
from llama_cluster import ASK_SETTINGS, QUESTION, chat, start, wait_listening

from colibrid.cluster.llama_build import LlamaBinaries, cache_dir


@pytest.fixture(scope="session")
def llama_bins() -> LlamaBinaries:
    return llama_binaries()


@pytest.fixture(scope="module")
def demo_export(demo_home: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "demo.gguf"
    r = subprocess.run(
        [sys.executable, "-m", "colibri_cli", "export", "demo", "--gguf", str(out), "--quiet"],
        env={**os.environ, "COLIBRI_HOME": str(demo_home)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return out


@dataclass
class Cluster:
    url: str
    port: int
    rpc: list[Process]
    server: Process
    single_url: str
    lines: list[str]


def plan_lines(demo_home: Path, gguf: Path, ports: list[int], http_port: int) -> list[str]:
    """The commands `colibri plan` prints for two loopback hosts."""
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
    argv = ["plan", "demo", "--hosts", "2", "--addresses", addresses, "--gguf", str(gguf)]
    argv += ["--port", str(http_port)]
    r = subprocess.run(
        [sys.executable, "-m", "colibri_cli", *argv],
        env={**os.environ, "COLIBRI_HOME": str(demo_home), "COLIBRI_LLAMA_DIR": str(cache_dir())},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    tail = r.stdout.split("commands: llama.cpp RPC", 1)[1].splitlines()[1:]
    return [line for line in tail if line and not line.startswith("#")]


def program(line: str, name: str) -> list[str] | None:
    argv = shlex.split(line)
    if not argv[0].endswith("/" + name):
        return None
    return [os.path.expanduser(argv[0]), *argv[1:]]


@pytest.fixture(scope="module")
def cluster(llama_bins: LlamaBinaries, demo_home: Path, demo_export: Path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("cluster-logs")
    ports, http_port, single_port = [free_port(), free_port()], free_port(), free_port()
    lines = plan_lines(demo_home, demo_export, ports, http_port)
    env = {**os.environ, "LLAMA_CACHE": str(logs / "rpc-cache")}  # rpc-server -c writes here
    with ExitStack() as stack:
        rpc_lines = [a for a in (program(x, "ggml-rpc-server") for x in lines) if a]
        assert len(rpc_lines) == 2, lines
        rpc = [start(stack, a, logs / f"rpc{i}.log", env) for i, a in enumerate(rpc_lines)]
        for proc, port in zip(rpc, ports, strict=True):
            wait_listening(proc, port)
        (server_argv,) = [a for a in (program(x, "llama-server") for x in lines) if a]
        # the plan's line, with llama.cpp's info log on (-lv 4: where each buffer went)
        server = start(stack, [*server_argv, "-lv", "4"], logs / "llama-server.log", env)
        url = f"http://127.0.0.1:{http_port}"
        # llama.cpp's own single process: the same program and GGUF, no --rpc
        single_argv = [str(llama_bins.llama_server), "-m", str(demo_export), "-c", "4096"]
        single_argv += ["--host", "127.0.0.1", "--port", str(single_port)]
        single = start(stack, single_argv, logs / "single.log", env)
        wait_healthy(server, url)
        wait_healthy(single, f"http://127.0.0.1:{single_port}")
        yield Cluster(url, http_port, rpc, server, f"http://127.0.0.1:{single_port}", lines)
        procs = [*rpc, server, single]
    assert all(p.proc.poll() is not None for p in procs), "a cluster process outlived the test"


def test_the_plan_lines_start_the_cluster_on_both_rpc_servers(cluster: Cluster) -> None:
    """llama-server put the model's layers on both RPC servers, as `-ngl all` asks."""
    log = cluster.server.tail(200_000)
    for proc in cluster.rpc:
        endpoint = f"127.0.0.1:{proc.argv[proc.argv.index('-p') + 1]}"
        sizes = re.findall(
            rf"RPC\d*\[{re.escape(endpoint)}\][^\n]*buffer size\s*=\s*([\d.]+) MiB", log
        )
        assert sizes and max(map(float, sizes)) > 10, f"{endpoint} holds no weights:\n{log[-3000:]}"


def test_cluster_answers_as_the_single_process_does(cluster: Cluster) -> None:
    spread = chat(cluster.url)["choices"][0]["message"]["content"]
    alone = chat(cluster.single_url)["choices"][0]["message"]["content"]
    assert spread.strip(), "the cluster answered nothing"
    assert spread == alone


def test_colibri_in_front_of_the_cluster(cluster: Cluster, demo_container: Path, tmp_path) -> None:
    """`colibri pull URL --name team`, then `colibri ask --model team` and the daemon's
    OpenAI endpoint both return the cluster's own answer."""
    from openai import OpenAI

    want = chat(cluster.url)["choices"][0]["message"]["content"]

    # the daemon's own model is the demo, which may well answer alike: each answer must
    # have been a task of the cluster's llama-server
    def tasks() -> int:
        return cluster.server.tail(10**7).count("| processing task")

    home = start_http(tmp_path / "home", demo_container)
    try:
        pulled = home.colibri("pull", cluster.url, "--name", "team")
        assert pulled.returncode == 0, pulled.stderr
        before = tasks()
        asked = home.colibri("ask", "--model", "team", QUESTION, timeout=300)
        assert asked.returncode == 0, asked.stderr + home.log()
        assert asked.stdout.strip() == want.strip()
        assert tasks() > before, "colibri ask did not reach the cluster"
        before = tasks()
        client = OpenAI(base_url=home.url + "/v1", api_key="unused")  # type: ignore[attr-defined]
        extra = {k: ASK_SETTINGS[k] for k in ("repeat_penalty", "repeat_last_n")}
        got = client.chat.completions.create(
            model="team",
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=ASK_SETTINGS["max_tokens"],
            extra_body=extra,
        )
        assert got.choices[0].message.content == want
        assert tasks() > before, "the OpenAI endpoint did not reach the cluster"
    finally:
        home.close()
