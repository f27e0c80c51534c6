"""`colibri bench peer --far DIR`: colibri and llama.cpp on a model several times larger
than the memory they may use, the same weights for both.

Method (docs/performance.md, side-by-side (b)):
1. DIR is a GLM-4.5-Air-shaped container (`colibri synth --shape glm4-air --layers N
   --experts 128`); its GGUF twin is written next to it once (`colibri export`: the same int4
   codes as Q4_0, 4.5 bits per weight for both).
2. A balloon (`colibrid.bench.balloon`) mlocks all but `--leave-gb` of the available
   memory for the whole run; the model must be at least 4x what is left.
3. Each runtime runs in its own process, one after the other, on the same random prompt
   and the same thread count: colibri streams experts through its tiered store (the
   budget it plans from what is available), llama.cpp maps the GGUF as users run models
   bigger than RAM (mmap, no weight repacking: repacking copies weights into RAM).
   Greedy decode, a few warm-up steps, then the measured steps.
4. Bytes read per token come from each process's own /proc/self/io (read_bytes: what it
   made the drive deliver, page faults and O_DIRECT alike); the O_DIRECT probe of the
   same run (random experts of this model, expert-sized reads) is the disk limit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from colibrid.bench.llama_peer import last_logits, llama_cpp_module, no_repack
from colibrid.errors import ConfigError

GB = 1e9
WARMUP = 4
PROBE_READS = 128


def read_bytes() -> int:
    """Bytes this process has made the storage layer deliver (Linux /proc/self/io)."""
    try:
        with open("/proc/self/io", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _colibri(model: Path, prompt: list[int], tokens: int, threads: int) -> dict[str, Any]:
    from colibrid.bench.stream import probe
    from colibrid.engine.engine import Engine
    from colibrid.store.budget import mem_available
    from colibrid.store.options import StoreOptions

    available = mem_available()
    engine = Engine.load(model, store=StoreOptions(mode="tiered"))
    try:
        store = engine.experts
        readers = store.pool.threads or 1  # the probe reads as the store does
        gbs, _ = probe(store, PROBE_READS, readers)
        session = engine.new_session()
        logits = session.prefill(prompt)
        out = []
        for _ in range(WARMUP):
            logits = session.decode(int(np.argmax(logits)))
        io0, t0 = read_bytes(), time.perf_counter()
        for _ in range(tokens):
            out.append(int(np.argmax(logits)))
            logits = session.decode(out[-1])
        wall = time.perf_counter() - t0
        io = read_bytes() - io0
        gbs = max(gbs, probe(store, PROBE_READS, readers, seed=1)[0])
        return {
            "runtime": "colibri",
            "tok_s": tokens / wall,
            "read_gb_per_token": io / GB / tokens,
            "probe_gbs": gbs,
            "available_gb": available / GB,
            "plan": store.plan.describe(),
            "tokens": out,
        }
    finally:
        engine.close()


def _llama(gguf: Path, prompt: list[int], tokens: int, threads: int) -> dict[str, Any]:
    llama_cpp = llama_cpp_module()
    with no_repack(llama_cpp):
        llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=len(prompt) + WARMUP + tokens + 16,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
    try:
        llm.eval(prompt)
        for _ in range(WARMUP):
            llm.eval([int(np.argmax(last_logits(llm)))])
        out = []
        io0, t0 = read_bytes(), time.perf_counter()
        for _ in range(tokens):
            out.append(int(np.argmax(last_logits(llm))))
            llm.eval([out[-1]])
        wall = time.perf_counter() - t0
        io = read_bytes() - io0
    finally:
        llm.close()
    return {
        "runtime": f"llama.cpp {getattr(llama_cpp, '__version__', '?')}",
        "tok_s": tokens / wall,
        "read_gb_per_token": io / GB / tokens,
        "tokens": out,
    }


def _child(argv: list[str]) -> int:
    kind, path, prompt, tokens, threads = argv
    ids = [int(t) for t in prompt.split(",")]
    run = _colibri if kind == "colibri" else _llama
    print(json.dumps(run(Path(path), ids, int(tokens), int(threads))))
    return 0


def _in_child(kind: str, path: Path, prompt: list[int], tokens: int, threads: int) -> dict:
    cmd = [sys.executable, "-m", "colibrid.bench.peer_far", "--child", kind, str(path)]
    cmd += [",".join(map(str, prompt)), str(tokens), str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"the {kind} run failed: {done.stderr.strip()[-600:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(model: Path, gguf: Path | None, leave_gb: float, tokens: int, prompt_tokens: int) -> dict:
    from colibrid.backends import native
    from colibrid.bench.decode import random_prompt
    from colibrid.convert import gguf_export
    from colibrid.store.checkpoint import Checkpoint

    with Checkpoint.open(model) as ckpt:
        config = dict(ckpt.config)
        size = sum(f.path.stat().st_size for f in ckpt.files)
    if size < 4 * leave_gb * (1 << 30):
        raise ConfigError(
            f"{model} is {size / GB:.1f} GB: the side-by-side needs at least 4x the "
            f"{leave_gb:g} GB left (more layers: colibri synth --shape glm4-air --layers N "
            "--experts 128, or a smaller --leave-gb)"
        )
    gguf = gguf or model.with_name(model.name + ".gguf")
    if not gguf.is_file():
        print(f"writing {gguf} (once): the same weights as Q4_0 ...", file=sys.stderr)
        gguf_export.export(model, gguf)
    prompt = random_prompt(int(config["vocab_size"]), prompt_tokens)
    threads = native.threads()
    balloon = subprocess.Popen(
        [sys.executable, "-m", "colibrid.bench.balloon", "--leave-gb", str(leave_gb)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = balloon.stdout.readline() if balloon.stdout else ""
        if not line.startswith("ready"):
            raise ConfigError("the memory balloon could not lock memory (needs root or ulimit -l)")
        locked = int(line.split()[1])
        ours = _in_child("colibri", model, prompt, tokens, threads)
        peer = _in_child("llama", gguf, prompt, tokens, threads)
    finally:
        if balloon.stdin:
            balloon.stdin.close()
        balloon.wait(timeout=60)
    same = sum(a == b for a, b in zip(ours["tokens"], peer["tokens"], strict=True))
    return {
        "model": str(model),
        "model_gb": size / GB,
        "gguf_gb": gguf.stat().st_size / GB,
        "locked_gb": locked / GB,
        "threads": threads,
        "colibri": ours,
        "peer": peer,
        "decode_ratio": ours["tok_s"] / peer["tok_s"],
        "same_tokens": same,
    }


def report(r: dict) -> str:
    ours, peer, gbs = r["colibri"], r["peer"], r["colibri"]["probe_gbs"]
    lines = [
        f"model {r['model_gb']:.1f} GB container / {r['gguf_gb']:.1f} GB GGUF; balloon locked "
        f"{r['locked_gb']:.1f} GB, {ours['available_gb']:.1f} GB left "
        f"({r['model_gb'] / ours['available_gb']:.1f}x smaller than the model); "
        f"{r['threads']} threads",
        f"O_DIRECT probe (random experts of this model): {gbs:.2f} GB/s",
        f"colibri plan: {ours['plan']}",
        f"{'':<22} {'decode tok/s':>12} {'GB read/token':>14} {'tok/s limit at probe':>21}",
    ]
    for x in (ours, peer):
        per = x["read_gb_per_token"]
        limit = f"{gbs / per:.3f}" if per > 0 else "-"
        lines.append(f"{x['runtime']:<22} {x['tok_s']:>12.3f} {per:>14.3f} {limit:>21}")
    lines.append(
        f"colibri / llama.cpp: decode {r['decode_ratio']:.2f}x; greedy tokens agree "
        f"{r['same_tokens']}/{len(ours['tokens'])}"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    raise SystemExit("use `colibri bench peer --far DIR`")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
