"""`colibri bench stream`: decode speed while streaming experts, against the disk limit.

Measured in the same run (docs/performance.md): first an O_DIRECT probe reads randomly chosen
experts of this model (their real aligned extents, with the store's own reader threads)
into a slab arena and gives the drive's GB/s for expert-sized reads; then the model
decodes with the given budget. Printed: decode tok/s, expert GB/s achieved while reading
(and its ratio to the probe), the roofline tok/s = probe GB/s / (expert GB read per
token) and tok/s as a fraction of it, the strict roofline (only the bytes of the experts
the router chose that were not resident: with a precision plan, mostly the small cold
ones), beside the bytes read the fewest any cache of the same size could have read for
the routing of the run (Belady: the policy's limit), and the demand misses a token of each
MoE layer (one layer missing more than its neighbours is where a token waits).
Works on any model directory.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibrid.backends.base import DeviceLimits, DeviceTierStats, KernelFamily
from colibrid.bench.cache_bound import fewest_read_bytes
from colibrid.bench.replay import add_store_flags, engine_ops, store_options, take_pass
from colibrid.store.read_probe import probe

__all__ = ["probe"]  # the disk probe, where the other benches import it from


def tier_line(now: DeviceTierStats, before: DeviceTierStats, tokens: int) -> str:
    """The device tier over the measured tokens: what it held, how many weight uses it
    served, and what crossed to the device per token (the bus's share of a token)."""
    hits, copies = now.hits - before.hits, now.copies - before.copies
    host = now.host_experts - before.host_experts
    copied = (now.copied_bytes - before.copied_bytes) / 1e9 / tokens
    budget = "no budget" if now.budget is None else f"budget {now.budget / 1e9:.3g} GB"
    rate = f"{100 * hits / (hits + copies):.1f}%" if hits + copies else "-"
    return (
        f"vram: {now.bytes / 1e9:.3f} GB held ({budget}; {now.expert_weights // 3} experts' "
        f"weights); {rate} of weight uses served from it; {copies / tokens:.1f} copies in "
        f"({copied:.4f} GB) a token, {(now.passed - before.passed) / tokens:.1f} of them "
        "expert weights used once and not kept"
        + (f"; {host / tokens:.1f} experts a token computed on the host" if host else "")
        + (f"\nvram: {now.host_rule}" if now.host_rule else "")
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri bench stream", description=__doc__)
    p.add_argument("--model", type=Path, required=True, metavar="DIR")
    p.add_argument("--tokens", type=int, default=16, help="decode steps measured")
    p.add_argument("--warmup", type=int, default=2, help="decode steps before measuring")
    p.add_argument("--probe-reads", type=int, default=64)
    p.add_argument("--ids", default="1,2,3,4,5,6,7,8", metavar="1,2,3", help="prompt ids")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample the decoded tokens at this temperature (seeded) instead of greedy: a "
        "random-weight synthetic model decoded greedily soon repeats one token, so its "
        "routing stops moving and every expert hits; sampling keeps it moving as real "
        "text does (default 0: greedy)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature)")
    p.add_argument(
        "--family",
        choices=[f.value for f in KernelFamily],
        default="f32",
        help="kernel family (i8: int8 activations, lossy, opt-in; on a few cores it computes "
        "a token's dense and expert matrices faster, which matters once reads overlap)",
    )
    p.add_argument(
        "--against",
        type=Path,
        metavar="DIR",
        help="a second container (e.g. the uniform one a precision plan was made from): "
        "both decode the same prompt at the same budget, alternated --rounds times, and a "
        "table compares tok/s, bytes read a token and the strict roofline of each run",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="with --against: runs of each container, alternated (default 2)",
    )
    add_store_flags(p)
    return p


def token_picker(temperature: float, seed: int) -> Callable[[np.ndarray], int]:
    """Greedy at temperature 0, else seeded softmax sampling (same seed, same tokens)."""
    if temperature < 0:
        raise SystemExit("bench stream: --temperature must be >= 0")
    if temperature == 0:
        return lambda logits: int(np.argmax(logits))
    rng = np.random.default_rng(seed)

    def sample(logits: np.ndarray) -> int:
        z = np.asarray(logits, dtype=np.float64).reshape(-1) / temperature
        p = np.exp(z - z.max())
        return int(rng.choice(p.size, p=p / p.sum()))

    return sample


@dataclass(frozen=True)
class StreamRun:
    """One run's figures, each beside the limit measured in the same run."""

    model: Path
    tok_s: float
    gb_read: float  # expert GB read a token
    gb_needed: float  # GB of the chosen experts that were not resident, a token
    probe_gbs: float
    hit: float

    @property
    def strict_roofline(self) -> float:
        return self.probe_gbs / self.gb_needed if self.gb_needed > 0 else float("inf")


def main(argv: list[str]) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    args.parser = p
    if args.ram_gb is None and args.cache is None:
        p.error("give --ram-gb N (or --cache N)")
    if args.against is None:
        return 0 if measure(args.model, args) is not None else 1
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    store_options(args)  # a bad placement flag is this parser's error, before any run
    runs: list[StreamRun] = []
    for r in range(args.rounds):
        for model in (args.against, args.model):
            print(f"\n== round {r + 1}/{args.rounds}: {model}", flush=True)
            run = measure_apart(model, args)
            if run is None:
                return 1
            runs.append(run)
    print()
    print(comparison(runs, args.model, args.against))
    return 0


def comparison(runs: list[StreamRun], model: Path, against: Path) -> str:
    """The runs in order, then each of MODEL's runs over the AGAINST run just before it
    (same minutes of a shared machine: the ratios are what holds). The strict rooflines'
    ratio prices both runs at the faster of their two probes, the same drive: it is the
    inverse ratio of their needed bytes."""
    lines = [
        "| run | container | tok/s | hit | GB read a token | needed GB a token | "
        "probe GB/s | strict roofline tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs, 1):
        lines.append(
            f"| {i} | {r.model.name} | {r.tok_s:.3f} | {100 * r.hit:.1f}% | {r.gb_read:.4g} | "
            f"{r.gb_needed:.4g} | {r.probe_gbs:.2f} | {r.strict_roofline:.4g} |"
        )
    pairs = [(a, b) for a, b in zip(runs[::2], runs[1::2], strict=True)]
    for name, ratio in (
        ("tok/s", lambda a, b: b.tok_s / a.tok_s),
        ("bytes read a token", lambda a, b: b.gb_read / a.gb_read if a.gb_read else 0.0),
        ("needed bytes a token", lambda a, b: b.gb_needed / a.gb_needed if a.gb_needed else 0.0),
        # one drive: each pair's faster probe for both (a probe moment must not decide)
        (
            "strict roofline at the pair's faster probe",
            lambda a, b: a.gb_needed / b.gb_needed if b.gb_needed else 0.0,
        ),
    ):
        each = [ratio(a, b) for a, b in pairs]
        lines.append(
            f"{model.name} / {against.name}, {name}: "
            + ", ".join(f"{x:.3f}" for x in each)
            + f" (median {float(np.median(each)):.3f})"
        )
    return "\n".join(lines)


def measure_apart(model: Path, args: argparse.Namespace) -> StreamRun | None:
    """:func:`measure` in a fresh process: each run starts from the memory a lone `bench
    stream` would (an engine closed in this process leaves pages mapped and allocator
    arenas behind, which the next run's memory watch would count against its budget)."""
    child = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "parser"})
    sys.stdout.flush()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, model, child).result()


def layer_misses_line(per_token: dict[int, float], listed: int = 8) -> str:
    """Demand misses a token per MoE layer: every layer when there are few, else the
    median, and the layers that miss most (where a token waits)."""
    head = "stream: demand misses a token by MoE layer:"
    if not per_token:
        return f"{head} none served"
    if len(per_token) <= listed:
        return f"{head} " + ", ".join(f"{la}: {m:.2f}" for la, m in sorted(per_token.items()))
    ranked = sorted(per_token.items(), key=lambda lm: (-lm[1], lm[0]))
    values = sorted(per_token.values())
    median = values[len(values) // 2]
    most = ", ".join(f"{la}: {m:.2f}" for la, m in ranked[:3])
    return (
        f"{head} median {median:.2f} over {len(values)} layers (fewest {values[0]:.2f}); "
        f"most: {most}"
    )


def measure(model: Path, args: argparse.Namespace) -> StreamRun | None:
    """Load ``model`` at the budget, probe the drive, decode, print the figures."""
    from colibrid.engine.engine import Engine

    family = KernelFamily(args.family)
    engine = Engine.load(
        model, family=family, ops=engine_ops(args, family), store=store_options(args)
    )
    store = engine.experts
    if not store.reads_experts():
        print("bench stream: experts are resident for this model; nothing streams")
        engine.close()
        return None
    threads = store.pool.threads or 1
    gbs, nbytes = probe(store, args.probe_reads, threads)
    print(
        f"probe: {nbytes / 1e9:.2f} GB in expert-sized reads ({store.files.mode}, "
        f"{threads} threads): {gbs:.2f} GB/s"
    )
    print(store.budget_plan.describe())
    if isinstance(engine.ops, DeviceLimits):  # the device's limits beside the disk's
        print(engine.ops.limits()[1])
    kind = engine.family.value  # what the passes compute with, as the engine holds it
    print(f"kernel family: {kind}" + (" (int8 activations: lossy)" if kind == "i8" else ""))
    print(f"slots: {store.plan.describe()}; pins: {store.pins.note}")
    session = engine.new_session()
    next_token = token_picker(args.temperature, args.seed)
    logits = session.prefill([int(x) for x in args.ids.split(",") if x])
    for _ in range(args.warmup):
        logits = session.decode(next_token(logits))
    base = store.stats.copy()
    misses_base = dict(store.server.misses_by_layer)
    tier_base = engine.ops.device_tier()
    store.take_usage()  # starts the feed: each measured token's routing (the cache bound)
    trace: list = []
    wall = 0.0
    for _ in range(args.tokens):
        t0 = time.perf_counter()
        logits = session.decode(next_token(logits))
        wall += time.perf_counter() - t0
        trace.append(take_pass(store))
    st = store.statistics(since=base)
    # Probe again after decoding and keep the faster figure: the drive (and a VM's host
    # cache behind it) drifts, and a slow probe moment must not flatter the ratios.
    gbs_after, _ = probe(store, args.probe_reads, threads, seed=1)
    print(f"probe after decode: {gbs_after:.2f} GB/s; limit used: {max(gbs, gbs_after):.2f} GB/s")
    gbs = max(gbs, gbs_after)
    tok_s = args.tokens / wall
    gb_tok = st.bytes_read / 1e9 / args.tokens
    roof = gbs / gb_tok if gb_tok > 0 else float("inf")
    print(
        f"decode: {tok_s:.3f} tok/s over {args.tokens} tokens; hit {100 * st.hit_rate:.1f}%; "
        f"{gb_tok:.3f} GB read/token"
    )
    print(
        f"disk: {st.read_gb_s:.2f} GB/s achieved vs probe {gbs:.2f} GB/s "
        f"= {100 * st.read_gb_s / gbs:.0f}%"
    )
    if roof != float("inf"):
        print(
            f"roofline: {roof:.3f} tok/s (probe GB/s / GB per token); achieved "
            f"{100 * tok_s / roof:.0f}% of it"
        )
        # The stricter limit: only the experts a token needed that were not resident when
        # the router chose them (demand misses + prefetched hits), so PILOT's mispredicted
        # reads are not forgiven; their own read bytes, so a mixed-precision container's
        # misses (mostly its small cold experts) count what they are, not a mean size.
        needed = st.needed_bytes / 1e9 / args.tokens
        if needed > 0:
            strict = gbs / needed
            print(
                f"roofline (needed experts only): {strict:.3f} tok/s ({needed:.4g} GB of "
                f"non-resident experts per token); achieved {100 * tok_s / strict:.0f}%"
            )
    else:
        print("roofline: no expert reads during decode (everything hit): not disk-bound")
    fewest = fewest_read_bytes(store, trace) / 1e9 / args.tokens
    print(
        f"cache: {gb_tok:.4g} GB read/token; the fewest any cache "
        f"of this size could read for this routing: {fewest:.4g} (Belady, best starting content)"
    )
    # Which limit binds: the CPU time a token takes (everything but waiting for reads)
    # against the disk time its non-resident experts need at the probe's speed.
    cpu_ms = 1e3 * (wall - st.io_wait_s) / args.tokens
    disk_ms = 1e3 * st.bytes_read / 1e9 / gbs / args.tokens
    bound = "disk" if disk_ms >= cpu_ms else "compute"
    print(
        f"bound: {bound} ({disk_ms:.0f} ms of reads per token at probe speed vs "
        f"{cpu_ms:.0f} ms of compute per token; the larger one is the floor)"
    )
    for line in st.lines("stream"):
        print(line)
    misses = store.server.misses_by_layer
    per_token = {la: (n - misses_base.get(la, 0)) / args.tokens for la, n in misses.items()}
    print(layer_misses_line(per_token))
    tier = engine.ops.device_tier()
    if tier is not None and tier_base is not None:
        print(tier_line(tier, tier_base, args.tokens))
    engine.close()
    sys.stdout.flush()
    return StreamRun(
        model=model,
        tok_s=tok_s,
        gb_read=gb_tok,
        gb_needed=st.needed_bytes / 1e9 / args.tokens,
        probe_gbs=gbs,
        hit=st.hit_rate,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
