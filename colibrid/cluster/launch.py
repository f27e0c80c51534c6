"""The exact command lines of a cluster: llama.cpp RPC for CPU hosts, vLLM or SGLang
with expert parallelism for GPU nodes, and colibri in front of either.

Why generated: the lines must agree with each other (the same ports in ``rpc-server``
and in ``--rpc``, the same ranks, address and sizes on every vLLM or SGLang node), and a
hand-copied recipe drifts. Each is a plain argv, quoted with :func:`shlex.join`, so what
is printed is what runs. The engine flags are the engines' own (llama.cpp as pinned by
``colibri llama-build``; vLLM's data-parallel + expert-parallel deployment; SGLang's
``launch_server`` multi-node flags): docs/beyond-one-machine.md explains each.

The engine that answers HTTP binds the loopback of the first host: colibri's daemon runs
there and is the door users and tools knock on (``colibri pull http://... --name``), so
the engine needs no key and no public port of its own.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

RPC_PORT = 50052  # llama.cpp's default rpc-server port
LLAMA_PORT = 8081
VLLM_PORT = 8000
VLLM_RPC_PORT = 13345
SGLANG_PORT = 30000
SGLANG_INIT_PORT = 20000


@dataclass(frozen=True)
class Step:
    """One command to run, and on which host."""

    where: str
    argv: tuple[str, ...]

    def line(self) -> str:
        """The shell line: quoted, but a program under ``~/`` keeps its tilde (each host
        expands it to its own home, where ``colibri llama-build`` put the program)."""
        program, *rest = self.argv
        head = "~/" + shlex.quote(program[2:]) if program.startswith("~/") else shlex.quote(program)
        return " ".join([head, *map(shlex.quote, rest)])


@dataclass(frozen=True)
class Endpoint:
    """A host's address and the port its rpc-server listens on."""

    host: str
    port: int = RPC_PORT

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def pull(name: str, port: int) -> Step:
    return Step("host 1", ("colibri", "pull", f"http://127.0.0.1:{port}", "--name", name))


def llama_rpc(
    hosts: Sequence[Endpoint],
    *,
    bin_dir: str,
    model: str,
    gguf: str,
    name: str,
    context: int,
    port: int = LLAMA_PORT,
) -> list[Step]:
    """Export, build on every host, one rpc-server a host, llama-server on the first with
    every layer on the RPC servers (``-ngl all``), colibri in front."""
    steps = [Step("host 1", ("colibri", "export", model, "--gguf", gguf))]
    steps.append(Step("every host", ("colibri", "llama-build")))
    for i, h in enumerate(hosts, 1):
        rpc = (f"{bin_dir}/ggml-rpc-server", "-H", h.host, "-p", str(h.port), "-c")
        steps.append(Step(f"host {i}", rpc))
    server = (f"{bin_dir}/llama-server", "-m", gguf, "--rpc", ",".join(map(str, hosts)))
    server += ("-ngl", "all", "-c", str(context), "--host", "127.0.0.1")
    server += ("--port", str(port))
    return [*steps, Step("host 1", server), pull(name, port)]


def vllm(
    nodes: Sequence[str], gpus: int, *, checkpoint: str, name: str, port: int = VLLM_PORT
) -> list[Step]:
    """``vllm serve`` on each node: attention data-parallel, experts spread over every GPU
    (--enable-expert-parallel; expert-parallel size = data-parallel size x 1)."""
    total = len(nodes) * gpus
    base = ("vllm", "serve", checkpoint, "--served-model-name", name)
    base += ("--tensor-parallel-size", "1", "--data-parallel-size", str(total))
    base += ("--enable-expert-parallel",)
    if len(nodes) == 1:
        serve = (*base, "--host", "127.0.0.1", "--port", str(port))
        return [Step("host 1", serve), pull(name, port)]
    multi = ("--data-parallel-size-local", str(gpus), "--data-parallel-address", nodes[0])
    multi += ("--data-parallel-rpc-port", str(VLLM_RPC_PORT))
    steps = [Step("host 1", (*base, *multi, "--host", "127.0.0.1", "--port", str(port)))]
    for i in range(1, len(nodes)):
        rank = ("--data-parallel-start-rank", str(i * gpus), "--headless")
        steps.append(Step(f"host {i + 1}", (*base, *multi, *rank)))
    return [*steps, pull(name, port)]


def sglang(
    nodes: Sequence[str], gpus: int, *, checkpoint: str, name: str, port: int = SGLANG_PORT
) -> list[Step]:
    """``sglang.launch_server`` on each node: tensor parallel over every GPU, the experts
    split the same way (--ep-size equal to --tp)."""
    total = str(len(nodes) * gpus)
    base = ("python", "-m", "sglang.launch_server", "--model-path", checkpoint)
    base += ("--served-model-name", name, "--tp", total, "--ep-size", total)
    serve = ("--host", "127.0.0.1", "--port", str(port))
    if len(nodes) == 1:
        return [Step("host 1", (*base, *serve)), pull(name, port)]
    init = ("--dist-init-addr", f"{nodes[0]}:{SGLANG_INIT_PORT}", "--nnodes", str(len(nodes)))
    steps = [
        Step(f"host {i + 1}", (*base, *init, "--node-rank", str(i), *(serve if i == 0 else ())))
        for i in range(len(nodes))
    ]
    return [*steps, pull(name, port)]
