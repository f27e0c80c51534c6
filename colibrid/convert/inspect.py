"""``colibri inspect DIR``: what a container (or any supported checkpoint) holds.

Why: before streaming a 400 GB model, a user wants to know what it will cost: how big
one expert read is, how many bytes a cold token pulls from disk, how much stays resident,
and which format each tensor class is in. Everything is computed from headers and
config.json after :func:`colibrid.engine.validate.validate` has checked them; no weight
byte is read. Works on upstream containers unchanged (format inferred from sizes).
``--verify`` then reads every byte against the manifest's digests
(:mod:`colibrid.convert.verify`).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from colibrid.convert.plan import classify, expert_of
from colibrid.engine.engine import DEFAULT_MAX_CONTEXT
from colibrid.engine.validate import stored_bytes, validate
from colibrid.errors import ColibriError
from colibrid.store.budget import MIN_WORK_SLOTS, GiB, minimum_budget
from colibrid.store.checkpoint import Checkpoint


@dataclass
class Report:
    path: Path
    model_type: str
    n_layers: int
    dense_layers: int
    moe_layers: int
    mtp_layers: int
    hidden: int
    vocab: int
    n_experts: int
    top_k: int
    shared: int
    expert_ffn: int
    formats: dict[str, Counter] = field(default_factory=dict)
    expert_bytes: int = 0  # the largest routed expert (a streaming slot's size)
    # (formats of its matrices, stored bytes) -> routed experts: one entry unless a
    # precision plan (`colibri requant --by-heat`) mixes them
    expert_kinds: Counter = field(default_factory=Counter)
    expert_contiguous: bool = False
    resident_bytes: int = 0
    routed_bytes: int = 0
    total_bytes: int = 0
    files: int = 0
    kv_bytes: int = 0  # KV cache at the daemon's default context
    context: int = 0

    @property
    def mean_expert_bytes(self) -> float:
        n = sum(self.expert_kinds.values())
        if not n:
            return float(self.expert_bytes)
        return sum(size * k for (_, size), k in self.expert_kinds.items()) / n

    @property
    def expert_bytes_per_token(self) -> int:
        return round(self.top_k * self.mean_expert_bytes * self.moe_layers)

    def size_lines(self) -> list[str]:
        """One line for one expert size; a line per format and size when a plan mixes them."""
        where = "adjacent" if self.expert_contiguous else "NOT adjacent"
        if len(self.expert_kinds) <= 1:
            return [
                f"expert size    {self.expert_bytes / 1e6:.2f} MB (gate+up+down with scales), "
                f"matrices {where}"
            ]
        out = [
            f"expert sizes   {len(self.expert_kinds)} kinds (gate+up+down with scales), "
            f"matrices {where}"
        ]
        for (fmts, size), n in sorted(self.expert_kinds.items(), key=lambda x: -x[0][1]):
            out.append(f"  {n:>6} x {size / 1e6:8.2f} MB  {fmts}")
        return out

    def lines(self) -> list[str]:
        gb = 1e9
        out = [
            f"container      {self.path}",
            f"architecture   {self.model_type}: {self.n_layers} layers ({self.dense_layers} dense"
            f" + {self.moe_layers} MoE) + {self.mtp_layers} MTP, hidden {self.hidden}, "
            f"vocab {self.vocab}",
            f"experts        {self.n_experts} routed per layer, top-{self.top_k}, "
            f"{self.shared} shared, FFN {self.expert_ffn}",
            "formats",
        ]
        for cls in ("expert", "shared", "attn", "dense", "io", "mtp", "f32"):
            if cls in self.formats:
                fmts = ", ".join(f"{f} x{n}" for f, n in sorted(self.formats[cls].items()))
                out.append(f"  {cls:<12} {fmts}")
        mean = ", mean expert" if len(self.expert_kinds) > 1 else ""
        out += self.size_lines()
        out += [
            f"resident       {self.resident_bytes / gb:.3f} GB (all but routed experts)",
            f"routed         {self.routed_bytes / gb:.3f} GB on disk",
            f"per token      {self.expert_bytes_per_token / gb:.3f} GB of experts when cold "
            f"({self.top_k} x {self.moe_layers} layers{mean})",
            f"total          {self.total_bytes / gb:.3f} GB in {self.files} files",
        ]
        if self.moe_layers and self.expert_bytes:
            least = minimum_budget(
                dense=self.resident_bytes, kv=self.kv_bytes, slot_bytes=self.expert_bytes
            )
            out.append(
                f"least RAM      {least / GiB:.2f} GiB to stream experts at a {self.context}-token"
                f" context (dense + KV {self.kv_bytes / GiB:.2f} + {MIN_WORK_SLOTS} work slabs"
                " + reserve); more RAM caches experts"
            )
        return out


def _adjacent(ckpt: Checkpoint, names: Sequence[str]) -> bool:
    if len({ckpt.file_of(n) for n in names}) != 1:
        return False
    spans = sorted((ckpt.info(n).file_begin, ckpt.info(n).file_end) for n in names)
    return all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))


def inspect(path: str | Path) -> Report:
    with Checkpoint.open(path) as ckpt:
        args, expected, formats, kv_per_position = validate(ckpt)
        t, moe = args.trunk, args.moe
        n_moe = sum(args.is_moe)
        mtp = sum(1 for n in expected if n.endswith("eh_proj.weight"))
        r = Report(
            Path(path),
            str(ckpt.config.get("model_type")),
            t.num_hidden_layers,
            t.num_hidden_layers - n_moe,
            n_moe,
            mtp,
            t.hidden_size,
            t.vocab_size,
            moe.n_routed_experts,
            moe.num_experts_per_tok,
            moe.n_shared_experts,
            moe.moe_intermediate_size,
        )
        first_expert: list[str] = []
        experts: dict[tuple[int, int], tuple[set[str], int]] = {}
        for name, exp in expected.items():
            cls = classify(name, exp.shape, t.num_hidden_layers)
            r.formats.setdefault(cls, Counter())[formats[name]] += 1
            size = stored_bytes(ckpt, name)
            ex = expert_of(name)
            if ex is not None and ex[0] < t.num_hidden_layers:
                r.routed_bytes += size
                fmts, nbytes = experts.get((ex[0], ex[1]), (set(), 0))
                experts[ex[0], ex[1]] = (fmts | {formats[name]}, nbytes + size)
                if not first_expert or (ex[0], ex[1]) == first_expert[0]:
                    first_expert = first_expert or [(ex[0], ex[1])]  # type: ignore[list-item]
                    first_expert.append(name)
            else:
                r.resident_bytes += size
        names = [n for n in first_expert[1:]]
        r.expert_kinds = Counter(("+".join(sorted(f)), b) for f, b in experts.values())
        r.expert_bytes = max((b for _, b in experts.values()), default=0)
        r.expert_contiguous = bool(names) and _adjacent(ckpt, names)
        r.total_bytes = sum(f.size for f in ckpt.files)
        r.files = len(ckpt.files)
        r.context = min(DEFAULT_MAX_CONTEXT, t.max_position_embeddings)
        r.kv_bytes = kv_per_position * r.context
    return r


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri inspect", description="Describe a colibri container or checkpoint."
    )
    p.add_argument("dir", metavar="NAME|DIR", help="an installed model's name, or a folder")
    p.add_argument(
        "--verify",
        action="store_true",
        help="also read every byte and check it against the digests in manifest.json: one "
        "line per tensor that differs, naming its shard; exit 1 if any does",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="with --verify: a container without digests fails too (exit 1)",
    )
    return p


def run_verify(path: Path, strict: bool) -> int:
    """`--verify`: the problems on stdout, one line each, the summary last."""
    from colibrid.convert.verify import progress_bar, total_bytes, verify

    bar = progress_bar(total_bytes(path))
    try:
        result = verify(path, None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()
    for line in result.problems:
        print(line)
    print(result.summary())
    return 1 if result.problems or (strict and result.note) else 0


def main(argv: Sequence[str]) -> int:
    a = build_parser().parse_args(list(argv))
    if a.strict and not a.verify:
        build_parser().error("--strict goes with --verify")
    try:
        from colibrid.config import resolve_model
        from colibrid.paths import Paths

        path = resolve_model(Paths.from_env(None), a.dir)
        described = True
        try:
            report = inspect(path)
        except ColibriError as exc:
            if not a.verify:
                raise
            # damaged bytes can make the description fail; the check below says where
            print(f"colibri inspect: error: {exc}", file=sys.stderr)
            described = False
        else:
            print("\n".join(report.lines()))
        if a.verify:
            return max(run_verify(path, a.strict), 0 if described else 1)
    except ColibriError as exc:
        print(f"colibri inspect: error: {exc}", file=sys.stderr)
        return 1
    return 0
