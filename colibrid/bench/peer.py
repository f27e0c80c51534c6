"""`colibri bench peer`: colibri and llama.cpp decode the same model in the same run.

The model is SmolLM2-135M-Instruct, the GGUF the demo is built from: llama.cpp runs the
GGUF as it is (Q4_1), colibri runs `demo-dense` (`colibri pull demo --dense`: the same
weights, every layer dense, int4-g64 but the embedding and head, int8). Both get the same
random prompt on the same threads; decode is greedy, one token per step, and each figure
stands beside the memory read probe of the same run. colibri runs in both kernel families
(f32, its default, and i8, which quantises activations to int8 as llama.cpp's Q4_1 dot
products do: the same arithmetic class), `--pairs N` alternates which runtime goes first,
and the report gives each ratio's median and range, the kernels' ISA and the share of
decode colibri's calling thread spent waiting for the pool's other threads. llama.cpp
comes from the optional extra `colibri[peer]` (llama-cpp-python 0.3.36; build it with
CMAKE_ARGS="-DGGML_NATIVE=ON" so it uses this CPU's vector units, as colibri does; on a
CPU with AMX whose VM does not grant the tiles, GGML_NATIVE builds a llama.cpp that
crashes: name the AVX-512 flags instead, docs/performance.md); it is never a test
dependency.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from colibrid.backends.base import KernelFamily
from colibrid.bench.llama_peer import last_logits, llama_cpp_module
from colibrid.errors import ConfigError


@dataclass
class PeerResult:
    runtime: str
    model: str
    prefill_tok_s: float
    decode_tok_s: float
    model_bytes: int


def llama_cpp_run(gguf: Path, prompt: list[int], tokens: int, threads: int) -> PeerResult:
    llama_cpp = llama_cpp_module()
    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=len(prompt) + tokens + 16,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    try:
        llm.eval(prompt[:16])  # fault the weights in, as colibri's measure does
        llm.reset()
        started = time.perf_counter()
        llm.eval(prompt)
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(tokens):
            llm.eval([int(np.argmax(last_logits(llm)))])
        decode_s = time.perf_counter() - started
    finally:
        llm.close()
    return PeerResult(
        f"llama.cpp {getattr(llama_cpp, '__version__', '?')}",
        str(gguf),
        len(prompt) / prefill_s,
        tokens / decode_s,
        gguf.stat().st_size,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri bench peer", description=__doc__)
    p.add_argument("--model", default="demo-dense", metavar="NAME|DIR", help="colibri model")
    p.add_argument("--gguf", metavar="FILE", help="the GGUF for llama.cpp (default: the demo's)")
    p.add_argument("--prompt-tokens", type=int, help="prefill length (default 256; 16 with --far)")
    p.add_argument("--tokens", type=int, help="decode steps measured (default 128; 16 with --far)")
    p.add_argument(
        "--far",
        metavar="DIR",
        help=(
            "side-by-side (b): this GLM-4.5-Air-shaped container (colibri synth --shape "
            "glm4-air) and its GGUF twin (written once, or --gguf), with all but --leave-gb "
            "of memory locked away"
        ),
    )
    p.add_argument(
        "--leave-gb", type=float, default=4.0, help="--far: GB of memory left to the runtimes"
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="runs of both runtimes, colibri first in every other one (default 1; the "
        "figures quoted in docs/performance.md use 8)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.prompt_tokens is None:
        args.prompt_tokens = 16 if args.far else 256
    if args.tokens is None:
        args.tokens = 16 if args.far else 128
    if args.prompt_tokens < 1 or args.tokens < 1 or args.pairs < 1:
        p.error("--prompt-tokens, --tokens and --pairs must be >= 1")
    llama_cpp_module()  # before minutes of measuring colibri, not after
    if args.far:
        from colibrid.bench import peer_far

        far = peer_far.run(
            Path(args.far),
            Path(args.gguf) if args.gguf else None,
            args.leave_gb,
            args.tokens,
            args.prompt_tokens,
        )
        print(json.dumps(far) if args.json else peer_far.report(far))
        return 0
    from colibrid.backends import native
    from colibrid.config import resolve_model
    from colibrid.convert import demo
    from colibrid.paths import Paths

    try:
        model_dir = resolve_model(Paths.from_env(None), args.model)
    except ConfigError:
        if args.model == demo.DENSE_NAME:
            raise ConfigError(
                f"no model {demo.DENSE_NAME!r}: build it with `colibri pull demo --dense`"
            ) from None
        raise
    gguf = Path(args.gguf) if args.gguf else demo.cache_dir() / Path(demo.GGUF_MEMBER).name
    if not gguf.is_file():
        raise ConfigError(f"{gguf}: no such GGUF (`colibri pull demo` downloads it; or --gguf)")
    say = (lambda _line: None) if args.json else print
    pairs = [
        run_pair(k, model_dir, gguf, args.prompt_tokens, args.tokens, say)
        for k in range(args.pairs)
    ]
    summary = summarise(pairs)
    if args.json:
        print(json.dumps({**pairs[-1], "pairs": pairs, "summary": summary}))
        return 0
    print(report(pairs, summary, native.threads(), model_dir.name))
    return 0


def run_pair(
    k: int,
    model_dir: Path,
    gguf: Path,
    prompt_tokens: int,
    tokens: int,
    say: Callable[[str], object],
) -> dict:
    """Pair ``k``: colibri in both kernel families and llama.cpp, on one random prompt,
    colibri first in even pairs and llama.cpp first in odd ones (so a drift of the machine
    during a run of pairs favours neither), beside the memory probe of the pair."""
    from colibrid.backends import native
    from colibrid.bench.decode import measure, random_prompt

    def ours(family: KernelFamily):  # noqa: ANN202
        return measure(model_dir, prompt_tokens=prompt_tokens, tokens=tokens, warmup=4,
                       family=family)  # fmt: skip

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = random_prompt(vocab, prompt_tokens)  # the prompt colibri's measure uses
    probe = native.membw_probe(1 << 29)
    peer = None
    if k % 2:
        peer = llama_cpp_run(gguf, prompt, tokens, native.threads())
    first = ours(KernelFamily.F32)
    second = ours(KernelFamily.I8)
    if peer is None:
        peer = llama_cpp_run(gguf, prompt, tokens, native.threads())
    membw = max(probe, native.membw_probe(1 << 29), first.membw_gbs, second.membw_gbs)
    pair = {
        "colibri": asdict(first),
        "colibri_i8": asdict(second),
        "peer": asdict(peer),
        "membw_gbs": membw,
        "decode_ratio": first.decode_tok_s / peer.decode_tok_s,
        "decode_ratio_i8": second.decode_tok_s / peer.decode_tok_s,
        "prefill_ratio": first.prefill_tok_s / peer.prefill_tok_s,
        "prefill_ratio_i8": second.prefill_tok_s / peer.prefill_tok_s,
    }
    say(
        f"pair {k + 1}: decode f32 {pair['decode_ratio']:.2f}x, i8 {pair['decode_ratio_i8']:.2f}x "
        f"({first.decode_tok_s:.1f} / {second.decode_tok_s:.1f} vs {peer.decode_tok_s:.1f} tok/s)"
    )
    return pair


def summarise(pairs: list[dict]) -> dict:
    """The median and range of each ratio over the pairs, and of the pool's wait share."""

    def spread(values: list[float]) -> dict:
        return {"median": float(np.median(values)), "min": min(values), "max": max(values)}

    keys = ("decode_ratio", "decode_ratio_i8", "prefill_ratio", "prefill_ratio_i8")
    out = {key: spread([p[key] for p in pairs]) for key in keys}
    for name, family in (("pool_wait_share", "colibri"), ("pool_wait_share_i8", "colibri_i8")):
        out[name] = spread([p[family]["pool_wait_share"] for p in pairs])
    out["isa"] = pairs[0]["colibri"]["isa"]
    out["pairs"] = len(pairs)
    return out


def report(pairs: list[dict], summary: dict, threads: int, name: str) -> str:
    last = pairs[-1]
    lines = [
        f"threads: {threads}; kernels: {summary['isa']}; memory read probe: "
        f"{max(p['membw_gbs'] for p in pairs):.1f} GB/s (best of the run)",
        f"{'last pair':<24} {'prefill tok/s':>14} {'decode tok/s':>13} {'weights':>10}",
    ]
    for label, row in (
        (f"colibri {name} f32", last["colibri"]),
        (f"colibri {name} i8", last["colibri_i8"]),
    ):
        lines.append(
            f"{label:<24} {row['prefill_tok_s']:>14.1f} {row['decode_tok_s']:>13.1f} "
            f"{row['weight_gb_per_token'] * 1e3:>7.0f} MB/token"
        )
    peer = last["peer"]
    lines.append(
        f"{peer['runtime']:<24} {peer['prefill_tok_s']:>14.1f} {peer['decode_tok_s']:>13.1f} "
        f"{peer['model_bytes'] / 1e6:>7.0f} MB file"
    )

    def ratio(key: str) -> str:
        r = summary[key]
        if summary["pairs"] == 1:
            return f"{r['median']:.2f}x"
        return f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"

    lines.append(
        f"colibri / llama.cpp over {summary['pairs']} pair(s), median (range): decode f32 "
        f"{ratio('decode_ratio')}, i8 {ratio('decode_ratio_i8')}; prefill f32 "
        f"{ratio('prefill_ratio')}, i8 {ratio('prefill_ratio_i8')}"
    )
    wait, wait_i8 = summary["pool_wait_share"], summary["pool_wait_share_i8"]
    lines.append(
        f"colibri's calling thread waiting for the pool: {100 * wait['median']:.1f}% of decode "
        f"(f32), {100 * wait_i8['median']:.1f}% (i8)"
    )
    return "\n".join(lines)
