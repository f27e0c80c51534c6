"""``colibri convert SRC DST``: a checkpoint folder -> a colibri container, resumably.

Why it is built this way:

* **Bounded memory.** Each tensor is decoded and quantised one row block at a time
  (:mod:`colibrid.convert.source`) and streamed into the shard being written; only the
  scales of the current group are held. Peak memory is a few row blocks, not a shard.
* **Resumable and byte-identical.** The layout is planned up front from the source's
  tensor list and the parameters (:mod:`colibrid.convert.plan`). DST holds a progress
  file ``.colibri-convert.json`` (parameters, source fingerprint, finished shards,
  ``complete``), rewritten atomically after each shard; a re-run skips finished shards
  and redoes the rest, so an interrupted-then-resumed conversion produces exactly the
  bytes of an uninterrupted one. Different parameters or a different source in the same
  DST are refused.
* **Digests.** Each shard's writer hashes the bytes it writes (the whole file and every
  tensor, XXH3-64); the progress file keeps them per finished shard and
  ``manifest.json`` records them all, so ``colibri inspect --verify`` and the daemon can
  hold the container to them (docs/formats.md).
* **Never looks complete when it is not.** The progress file (``complete: false``) is
  written before the first shard, shards are renamed into place only when fsynced, and
  ``manifest.json`` plus ``complete: true`` come last; :class:`Checkpoint` refuses a
  folder whose progress file says incomplete.
* **Disk safety.** Free space is checked before each shard; ENOSPC/EFBIG during a write
  removes the partial file and ends with one error line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibrid.convert.order import ExpertOrderProfile
from colibrid.convert.plan import (
    CONVERTER_VERSION,
    ConvertParams,
    Group,
    Shard,
    build_groups,
    pack_shards,
)
from colibrid.convert.source import Source
from colibrid.convert.writer import ShardWriter, write_atomic
from colibrid.errors import ColibriError, ConvertError
from colibrid.formats import quant
from colibrid.formats.weights import WeightFormat
from colibrid.store.integrity import HASH, ShardDigest, file_digests
from colibrid.store.safetensors_file import SafetensorsFile

PROGRESS_NAME = ".colibri-convert.json"
MANIFEST_NAME = "manifest.json"
DIGESTS_KEY = "digests"  # the progress file's {shard: manifest entry} of written shards
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
)
DISK_MARGIN = 64 << 20
MXFP4_NOTE = (
    "colibri convert: note: the source's experts are MXFP4; --mxfp4 convert --bits {bits} "
    "requantises them (lossy); --mxfp4 keep (the default) stores them as they are"
)


@dataclass
class ConvertResult:
    dst: Path
    shards: int
    written_shards: int
    bytes_written: int
    total_bytes: int
    seconds: float


# ---- producing a group's bytes -----------------------------------------------------


def group_chunks(source: Source, group: Group) -> Iterator[tuple[str, np.ndarray]]:
    """(entry name, bytes) in the group's file order: every item's data, then scales."""
    by_name = {t.name: t for t in source.tensors}
    scales: list[tuple[str, np.ndarray]] = []
    for item in group.items:
        t = by_name[item.name]
        fmt = item.fmt
        if fmt.fp4:  # an MXFP4 matrix as stored: codes, then its e8m0 scale bytes
            try:
                qw = source.fp4(t)
            except ValueError as exc:
                raise ConvertError(f"tensor {item.name!r}: {exc}") from None
            yield item.name, qw.data
            scales.append((item.name + ".qs", qw.scales))
            continue
        blocks: list[np.ndarray] = []
        for block in source.rows(t):
            if fmt.bits == 32:
                yield item.name, np.ascontiguousarray(block, dtype=np.float32)
                continue
            if fmt.bits == 16:
                yield item.name, quant.f32_to_bf16(block)
                continue
            wf = WeightFormat.Q8 if fmt.bits == 8 else WeightFormat.Q4
            try:
                qw = quant.quantize(block, wf, fmt.group_size)
            except ValueError as exc:
                raise ConvertError(f"tensor {item.name!r}: {exc}") from None
            yield item.name, qw.data.view(np.uint8)
            blocks.append(qw.scales)
        if fmt.quantised:
            scales.append((item.name + ".qs", np.concatenate(blocks, axis=0)))
    yield from scales


# ---- progress / resume -------------------------------------------------------------


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _state_bytes(state: dict) -> bytes:
    return (json.dumps(state, indent=1, sort_keys=True) + "\n").encode()


def prepare_dst(dst: Path, params: ConvertParams, fingerprint: list) -> dict:
    """Load (resume) or create the progress state; refuse mixed parameter sets."""
    identity = {"converter": CONVERTER_VERSION, "params": params.to_json(), "source": fingerprint}
    progress = dst / PROGRESS_NAME
    if dst.exists() and not dst.is_dir():
        raise ConvertError(f"{dst}: exists and is not a directory")
    if progress.exists():
        state = _read_json(progress)
        if not isinstance(state, dict):
            raise ConvertError(f"{progress}: unreadable progress file; remove {dst} to restart")
        for key, want in identity.items():
            if state.get(key) != want:
                raise ConvertError(
                    f"{dst}: holds a conversion with different {key} "
                    f"({json.dumps(state.get(key))[:120]}); refusing to mix parameter sets "
                    "in one container (use a new DST or the same options)"
                )
        return state
    if dst.exists() and any(dst.iterdir()):
        raise ConvertError(f"{dst}: exists, is not empty and is not a colibri conversion")
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConvertError(f"{dst}: cannot create ({exc.strerror})") from None
    state = {**identity, "shards": {}, "complete": False}
    write_atomic(progress, _state_bytes(state))
    return state


def check_disk(dst: Path, need: int, shard: str) -> None:
    free = shutil.disk_usage(dst).free
    if free < need + DISK_MARGIN:
        raise ConvertError(
            f"{dst}: not enough free disk for {shard}: needs {need / 1e9:.2f} GB "
            f"(+{DISK_MARGIN >> 20} MiB margin), {free / 1e9:.2f} GB free"
        )


def write_shard(
    dst: Path, shard: Shard, chunks: Iterator[tuple[str, np.ndarray]], bar: object | None
) -> ShardDigest:
    """Write one planned shard; its digests, hashed as the bytes went by."""
    path = dst / shard.name
    with ShardWriter(path, shard.entries, shard.metadata) as w:
        for name, chunk in chunks:
            w.write(name, chunk)
            if bar is not None:
                bar.update(chunk.nbytes)  # type: ignore[attr-defined]
        w.finish()
    assert w.digests is not None
    return w.digests


def copy_side_files(src: Path, dst: Path, config: dict) -> None:
    cfg = dict(config)
    cfg.pop("quantization_config", None)  # the container is no longer FP8/NVFP4
    write_atomic(dst / "config.json", (json.dumps(cfg, indent=2) + "\n").encode())
    for name in SIDE_FILES:
        p = src / name
        if p.is_file():
            write_atomic(dst / name, p.read_bytes())


def make_progress_bar(  # type: ignore[no-untyped-def]
    total: int, initial: int, quiet: bool, desc: str = "convert"
):
    if quiet or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        desc=desc,
        smoothing=0.1,
    )


def run_shards(
    dst: Path, shards: Sequence[Shard], state: dict, chunks_of, *, quiet: bool
) -> tuple[int, int]:
    """Write every shard not yet recorded as done; returns (written shards, bytes)."""
    done: dict = state.setdefault("shards", {})
    for stale in dst.glob(".*.partial"):
        stale.unlink(missing_ok=True)
    total = sum(s.nbytes for s in shards)
    finished = {
        s.name
        for s in shards
        if done.get(s.name) == s.nbytes
        and (dst / s.name).is_file()
        and (dst / s.name).stat().st_size == s.nbytes
    }
    initial = sum(s.nbytes for s in shards if s.name in finished)
    bar = make_progress_bar(total, initial, quiet)
    written = nbytes = 0
    try:
        for shard in shards:
            if shard.name in finished:
                continue
            done.pop(shard.name, None)
            (dst / shard.name).unlink(missing_ok=True)
            check_disk(dst, shard.nbytes, shard.name)
            digests = write_shard(dst, shard, chunks_of(shard), bar)
            nbytes += shard.nbytes
            written += 1
            done[shard.name] = shard.nbytes
            state.setdefault(DIGESTS_KEY, {})[shard.name] = digests.manifest_entry()
            write_atomic(dst / PROGRESS_NAME, _state_bytes(state))
    finally:
        if bar is not None:
            bar.close()
    return written, nbytes


def shard_digests(dst: Path, shard: Shard, state: dict) -> dict:
    """The manifest entry of a written shard: from the progress file, where the writer
    left its digests, or hashed from the file for a shard an older colibri wrote (a
    conversion it began and this one resumes)."""
    entry = state.get(DIGESTS_KEY, {}).get(shard.name)
    if isinstance(entry, dict) and entry.get("bytes") == shard.nbytes:
        return entry
    with SafetensorsFile.open(dst / shard.name) as f:
        ranges = [(t.name, t.file_begin, t.file_end) for t in f.tensors.values()]
    return file_digests(dst / shard.name, ranges).manifest_entry()


def finish(dst: Path, shards: Sequence[Shard], state: dict, extra: dict) -> None:
    """Write manifest.json (with every shard's digests), then mark the folder complete."""
    manifest = {
        "converter": CONVERTER_VERSION,
        "params": state["params"],
        "hash": HASH,
        "shards": [shard_digests(dst, s, state) for s in shards],
        "tensors": sum(len(s.entries) for s in shards),
        **extra,
    }
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    write_atomic(dst / MANIFEST_NAME, text.encode())
    state["complete"] = True
    write_atomic(dst / PROGRESS_NAME, _state_bytes(state))


def convert(
    src: str | Path,
    dst: str | Path,
    params: ConvertParams | None = None,
    *,
    order: str | Path | None = None,
    force: bool = False,
    quiet: bool = True,
) -> ConvertResult:
    """Convert ``src`` into the container ``dst`` (resuming a previous run there)."""
    from colibrid.models import family

    params = params or ConvertParams()
    started = time.perf_counter()
    profile = ExpertOrderProfile.load(order) if order is not None else None
    if profile is not None:
        params = ConvertParams(**{**params.to_json(), "order": profile.digest})
    params.check(force=force)
    dst = Path(dst)
    source = Source.open(src)
    try:
        try:
            args = family(source.config.get("model_type")).ModelArgs.from_config(source.config)
        except ColibriError as exc:
            raise ConvertError(f"{source.dir}: {exc}") from None
        n_layers = args.trunk.num_hidden_layers
        keep = params.mxfp4 == "keep"
        groups = build_groups(
            [(t.name, t.shape) for t in source.tensors],
            n_layers,
            params,
            profile.order if profile else None,
            frozenset(t.name for t in source.tensors if keep and t.kind == "mxfp4"),
        )
        shards = pack_shards(groups, params)
        state = prepare_dst(dst, params, source.fingerprint())
        mxfp4 = any(t.kind == "mxfp4" for t in source.tensors)
        if not keep and params.expert_bits in (4, 8) and mxfp4:
            print(MXFP4_NOTE.format(bits=params.expert_bits), file=sys.stderr)
        total = sum(s.nbytes for s in shards)
        if state.get("complete"):
            return ConvertResult(dst, len(shards), 0, 0, total, 0.0)

        def chunks_of(shard: Shard) -> Iterator[tuple[str, np.ndarray]]:
            for g in shard.groups:
                yield from group_chunks(source, g)

        written, nbytes = run_shards(dst, shards, state, chunks_of, quiet=quiet)
        copy_side_files(source.dir, dst, source.config)
        finish(dst, shards, state, {})
    finally:
        source.close()
    return ConvertResult(dst, len(shards), written, nbytes, total, time.perf_counter() - started)


# ---- command line ------------------------------------------------------------------


def add_quant_options(p: argparse.ArgumentParser) -> None:
    """The number formats of a conversion (shared by `colibri convert` and `pull`)."""
    p.add_argument(
        "--bits",
        type=int,
        default=4,
        choices=(4, 8, 16, 32),
        help="routed experts (16: bf16, 32: f32); MXFP4 experts follow --mxfp4",
    )
    p.add_argument(
        "--mxfp4",
        choices=("keep", "convert"),
        default="keep",
        help="MXFP4 experts (gpt-oss): keep them as stored, 4-bit codes with their e8m0 "
        "scales, lossless (default), or convert them to --bits",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=64,
        help="int4 group size (0 = one scale per row; default 64)",
    )
    for cls, default, what in (
        ("io", 8, "embeddings and lm_head"),
        ("attn", 4, "attention and DSA indexer"),
        ("dense", 4, "dense MLPs"),
        ("shared", 4, "shared experts"),
        ("mtp", 8, "the MTP layer (int4 must be allowed explicitly)"),
    ):
        p.add_argument(
            f"--{cls}-bits",
            type=int,
            default=default,
            choices=(4, 8, 32),
            help=f"{what} (32 = keep f32; default {default})",
        )
    p.add_argument("--shard-gb", type=float, default=4.0, help="shard size bound (GB)")


def params_from(a: argparse.Namespace) -> ConvertParams:
    return ConvertParams(
        expert_bits=a.bits,
        group_size=a.group_size,
        io_bits=a.io_bits,
        attn_bits=a.attn_bits,
        dense_bits=a.dense_bits,
        shared_bits=a.shared_bits,
        mtp_bits=a.mtp_bits,
        shard_bytes=int(a.shard_gb * 1e9),
        mxfp4=a.mxfp4,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri convert",
        description="Convert a checkpoint folder (f32/bf16/FP8/NVFP4 safetensors) into a "
        "colibri container. Re-running with the same options resumes.",
    )
    p.add_argument("src", metavar="SRC", help="checkpoint folder (config.json + *.safetensors)")
    p.add_argument("dst", metavar="DST", help="new container folder")
    add_quant_options(p)
    p.add_argument("--force", action="store_true", help="allow an int4 MTP layer")
    p.add_argument(
        "--order",
        metavar="PROFILE",
        help="write experts in co-firing order learned from a usage profile",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str]) -> int:
    a = build_parser().parse_args(list(argv))
    params = params_from(a)
    try:
        r = convert(a.src, a.dst, params, order=a.order, force=a.force, quiet=a.quiet)
    except ColibriError as exc:
        print(f"colibri convert: error: {exc}", file=sys.stderr)
        return 1
    if r.written_shards == 0 and r.bytes_written == 0 and r.seconds == 0.0:
        print(f"{r.dst}: already complete ({r.shards} shards, {r.total_bytes / 1e9:.2f} GB)")
        return 0
    rate = r.bytes_written / r.seconds / 1e6 if r.seconds else 0.0
    print(
        f"{r.dst}: {r.shards} shards, {r.total_bytes / 1e9:.3f} GB "
        f"({r.written_shards} written now, {rate:.0f} MB/s, {r.seconds:.1f} s)"
    )
    return 0
