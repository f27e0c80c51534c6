"""`colibri bench decode`: resident prefill and decode speed against the memory roofline
and the kernels' own speed.

With every expert in RAM, decode is a stream of weights through the cores: each token
reads the attention and dense weights, the shared experts, the output head and the routed
experts it chose. One limit is therefore memory read bandwidth divided by the weight bytes
a token touches. Both are measured in this run (docs/performance.md): the bytes by
counting every weight handed to the kernels during a few extra decode steps, the
bandwidth by the native read probe right before and right after decoding (the faster one
is the limit, so a noisy moment never flatters the ratio).

The other limit is arithmetic: on a few cores an int4 matrix in the F32 family (weights
widened to f32 in registers) can take longer to multiply than to read. So the same run
also times each kind of matrix the token used, at S = 1 with its weights hot in cache,
and adds up what the token's matrices cost at those speeds: the kernel floor. Decode can
beat neither limit; the lower one is what bounds it.

Printed: prefill tok/s (and its GFLOP/s from the same byte count, two flops per weight),
decode tok/s, GB of weights per token, the KV cache read per token at the end, the
roofline tok/s, the kernel floor tok/s and decode as a fraction of each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibrid.backends.base import KernelFamily
from colibrid.backends.kernel_speed import hot_seconds_per_byte
from colibrid.config import add_backend_flag
from colibrid.errors import ConfigError
from colibrid.formats.weights import QuantWeight

COUNTED_STEPS = 4  # decode steps whose weight bytes are counted (after the timed ones)

Shape = tuple[str, int, int, int]  # (format, Q4 group size, O, I): one kind of matrix


class CountingOps:
    """A backend (any), counting the weight bytes (data + scales) and weight elements
    (multiply-adds per row) it is handed while `counting` is on. Off, its methods are the
    backend's own bound methods, so timing runs pay nothing for it."""

    COUNTED = (
        "matmul",
        "matmul_many",
        "matmul_blocks",
        "expert_swiglu",
        "apply_experts",
        "moe",
        "gqa_attention",
        "embed",
    )

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.families = inner.families
        self.bytes = 0
        self.elements = 0
        self.by_shape: Counter[Shape] = Counter()  # bytes per kind of matrix
        self.weights: dict[Shape, QuantWeight] = {}  # one of each kind, to time it
        self.counting = False

    @property
    def counting(self) -> bool:
        return self._counting

    @counting.setter
    def counting(self, on: bool) -> None:
        self._counting = on
        for name in self.COUNTED:
            if on:
                self.__dict__.pop(name, None)  # the counting method of the class
            else:
                self.__dict__[name] = getattr(self.inner, name)

    def __getattr__(self, name: str) -> Any:
        """Every op that reads no weights is the backend's own (kept, so asked once)."""
        if name.startswith("_") or name == "inner":
            raise AttributeError(name)
        value = getattr(self.inner, name)
        self.__dict__[name] = value
        return value

    def _count(self, *weights: QuantWeight) -> None:
        for w in weights:
            self.bytes += w.nbytes
            self.elements += w.shape[0] * w.shape[1]
            shape = (w.fmt.value, w.group_size, *w.shape)
            self.by_shape[shape] += w.nbytes
            self.weights.setdefault(shape, w)

    def matmul(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        self._count(w)
        return self.inner.matmul(w, x, family)

    def matmul_many(self, weights, x, family):  # noqa: ANN001, ANN201
        self._count(*weights)
        return self.inner.matmul_many(weights, x, family)

    def matmul_blocks(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        self._count(w)
        return self.inner.matmul_blocks(w, x, family)

    def expert_swiglu(self, gate, up, down, x, family):  # noqa: ANN001, ANN201
        self._count(gate, up, down)
        return self.inner.expert_swiglu(gate, up, down, x, family)

    def apply_experts(self, batch, x, out, family):  # noqa: ANN001, ANN201
        for e, w in enumerate(batch.weights):
            if batch.start[e + 1] > batch.start[e]:
                self._count(w.gate, w.up, w.down)
        return self.inner.apply_experts(batch, x, out, family)

    def moe(self, x, weight, bias, rule, layer, shared, family):  # noqa: ANN001, ANN201
        ids, out = self.inner.moe(x, weight, bias, rule, layer, shared, family)
        for e in sorted(set(ids.ravel().tolist())):  # each chosen expert is read once
            w = layer.experts[e]
            self._count(w.gate, w.up, w.down)
        if shared is not None:
            self._count(shared.gate, shared.up, shared.down)
        return ids, out

    def gqa_attention(self, block, *args):  # noqa: ANN001, ANN002, ANN201
        self._count(block.q, block.k, block.v, block.o)
        return self.inner.gqa_attention(block, *args)

    def embed(self, table: QuantWeight, ids: np.ndarray) -> np.ndarray:
        self.bytes += len(ids) * table.nbytes // table.shape[0]  # one row per id
        return self.inner.embed(table, ids)


@dataclass
class Result:
    model: str
    threads: int
    prompt_tokens: int
    prefill_tok_s: float
    prefill_gflop_s: float
    decode_tokens: int
    decode_tok_s: float
    weight_gb_per_token: float
    kv_mb_per_token: float
    membw_gbs: float
    roofline_tok_s: float
    ratio: float
    kernel_floor_tok_s: float
    floor_ratio: float
    backend: str = "cpu"
    isa: str = ""  # the kernels' instruction set (the dispatched one: auto=...)
    pool_wait_share: float = 0.0  # of decode's wall time, the caller waiting for the pool
    pool_busy_share: float = 0.0  # of decode's wall time, inside the pool's parallel jobs


def random_prompt(vocab: int, tokens: int) -> list[int]:
    """The benchmark prompt: seeded random ids, so every runtime measured gets the same."""
    rng = np.random.default_rng(0)
    return [int(t) for t in rng.integers(1, vocab, tokens)]


def _greedy(session: Any, logits: np.ndarray, steps: int) -> np.ndarray:
    """Decode `steps` greedy tokens after `logits`; the last logits."""
    for _ in range(steps):
        logits = session.decode(int(np.argmax(logits)))
    return logits


def kernel_floor_s(ops: CountingOps, steps: int, family: KernelFamily) -> float:
    """Seconds one decode step's matrices take at their cache-hot kernel speed."""
    return sum(
        nbytes / steps * hot_seconds_per_byte(ops.weights[shape], family)
        for shape, nbytes in ops.by_shape.items()
    )


def measure(
    model_dir: Path,
    *,
    prompt_tokens: int,
    tokens: int,
    warmup: int,
    family: KernelFamily,
    backend: str = "cpu",
    vram_gb: float | None = None,
) -> Result:
    """The kernel floor is the CPU kernels' whatever the backend: the one speed this
    bench can time per matrix."""
    from colibrid.backends import native
    from colibrid.engine.backend import make_ops
    from colibrid.engine.engine import Engine
    from colibrid.engine.kv import bytes_per_position
    from colibrid.store.options import StoreOptions

    ops = CountingOps(make_ops(backend, family, vram_gb))
    engine = Engine.load(model_dir, family=family, ops=ops, store=StoreOptions(mode="resident"))
    try:
        needed = prompt_tokens + warmup + tokens + COUNTED_STEPS
        if needed > engine.max_context:
            raise ConfigError(
                f"--prompt-tokens {prompt_tokens} + --warmup {warmup} + --tokens {tokens} "
                f"(+ {COUNTED_STEPS} counted steps) need {needed} positions; this model's "
                f"context is {engine.max_context}: lower them"
            )
        prompt = random_prompt(engine.vocab_size, prompt_tokens)
        probe_before = native.membw_probe(1 << 29)

        engine.new_session().prefill(prompt[: min(16, prompt_tokens)])  # faults pages in
        session = engine.new_session()
        started = time.perf_counter()
        logits = session.prefill(prompt)
        prefill_s = time.perf_counter() - started
        logits = _greedy(session, logits, warmup)
        native.pool_stats(reset=True)
        started = time.perf_counter()
        logits = _greedy(session, logits, tokens)
        decode_s = time.perf_counter() - started
        pool = native.pool_stats(reset=True)

        probe_after = native.membw_probe(1 << 29)
        ops.counting = True
        _greedy(session, logits, COUNTED_STEPS)
        ops.counting = False
        gb_token = ops.bytes / COUNTED_STEPS / 1e9
        flops_token = 2 * ops.elements / COUNTED_STEPS
        kv_mb = bytes_per_position(engine.model.cache_layouts()) * session.length / 1e6
        floor_tok_s = 1.0 / kernel_floor_s(ops, COUNTED_STEPS, family)
    finally:
        engine.close()
    membw = max(probe_before, probe_after)
    roofline = membw / gb_token
    decode_tok_s = tokens / decode_s
    return Result(
        model=str(model_dir),
        threads=native.threads(),
        prompt_tokens=prompt_tokens,
        prefill_tok_s=prompt_tokens / prefill_s,
        prefill_gflop_s=flops_token * prompt_tokens / prefill_s / 1e9,
        decode_tokens=tokens,
        decode_tok_s=decode_tok_s,
        weight_gb_per_token=gb_token,
        kv_mb_per_token=kv_mb,
        membw_gbs=membw,
        roofline_tok_s=roofline,
        ratio=decode_tok_s / roofline,
        kernel_floor_tok_s=floor_tok_s,
        floor_ratio=decode_tok_s / floor_tok_s,
        backend=ops.name,
        isa=native.isa_label(),
        pool_wait_share=pool.wait_s / decode_s,
        pool_busy_share=pool.seconds / decode_s,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri bench decode", description=__doc__)
    p.add_argument("--model", required=True, metavar="NAME|DIR", help="model name or folder")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prefill length (default 256)")
    p.add_argument("--tokens", type=int, default=128, help="decode steps measured (default 128)")
    p.add_argument("--warmup", type=int, default=4, help="decode steps before measuring")
    p.add_argument(
        "--family", choices=[f.value for f in KernelFamily], default="f32", help="kernel family"
    )
    add_backend_flag(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    from colibrid.config import resolve_model
    from colibrid.paths import Paths

    if args.prompt_tokens < 1 or args.tokens < 1 or args.warmup < 0:
        p.error("--prompt-tokens and --tokens must be >= 1, --warmup >= 0")
    r = measure(
        resolve_model(Paths.from_env(None), args.model),
        prompt_tokens=args.prompt_tokens,
        tokens=args.tokens,
        warmup=args.warmup,
        family=KernelFamily(args.family),
        backend=args.backend or "auto",
        vram_gb=args.vram_gb,
    )
    if args.json:
        print(json.dumps(asdict(r)))
        return 0
    print(f"model: {r.model} ({r.backend} backend, {r.isa}, {r.threads} threads, experts resident)")
    print(f"memory read probe: {r.membw_gbs:.1f} GB/s (best of before and after decoding)")
    print(
        f"prefill: {r.prefill_tok_s:.1f} tok/s over {r.prompt_tokens} tokens "
        f"({r.prefill_gflop_s:.1f} GFLOP/s of weight multiply-adds)"
    )
    print(
        f"decode: {r.decode_tok_s:.1f} tok/s over {r.decode_tokens} tokens; "
        f"{r.weight_gb_per_token:.3f} GB of weights per token "
        f"(+ {r.kv_mb_per_token:.1f} MB of KV cache at the end)"
    )
    print(
        f"roofline: {r.roofline_tok_s:.1f} tok/s (probe GB/s / weight GB per token); "
        f"decode is {100 * r.ratio:.0f}% of it"
    )
    bound = "kernel arithmetic" if r.kernel_floor_tok_s < r.roofline_tok_s else "memory"
    print(
        f"kernel floor: {r.kernel_floor_tok_s:.1f} tok/s (the token's matrices at their "
        f"cache-hot S=1 kernel speed); decode is {100 * r.floor_ratio:.0f}% of it; "
        f"the lower limit: {bound}"
    )
    print(
        f"pool: {100 * r.pool_busy_share:.0f}% of decode in the kernels' parallel jobs; the "
        f"calling thread waited {100 * r.pool_wait_share:.1f}% of decode for chunks another "
        "thread was still computing"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
