"""``colibri export MODEL --gguf OUT``: a colibri model as a GGUF llama.cpp runs.

Why: a user who outgrows one machine moves to an engine that spreads a model over several
(llama.cpp's RPC servers load GGUF); the weights colibri already converted, tuned and
verified should go with them unchanged rather than be downloaded and converted again.
The stored blocks are re-encoded, not requantised (:mod:`colibrid.convert.gguf_blocks`);
names and keys follow llama.cpp's architecture of the family
(:mod:`colibrid.convert.gguf_arch`); the tokenizer and chat template come along
(:mod:`colibrid.convert.gguf_vocab`).

Written like ``colibri convert``:

* **Shards a network can stream.** ``--split-max-size`` cuts the file into llama.cpp's
  split naming ``OUT-00001-of-0000N.gguf`` (``split.no``, ``split.count``,
  ``split.tensors.count`` in each; the first holds every key), which llama.cpp loads from
  the first shard.
* **Resumable.** A marker ``.OUT.export.json`` beside the output records the source's
  fingerprint, the options and each finished shard; a re-run skips those (the bytes are
  deterministic) and refuses to mix another source or other options into the same name.
* **Atomic and disk-safe.** Each shard is written under a hidden ``.partial`` name,
  fsynced and renamed; free space is checked before each; a full disk removes the partial
  file and ends with one error line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibrid.convert.convert import check_disk, make_progress_bar
from colibrid.convert.gguf_arch import Family, family_of
from colibrid.convert.gguf_tensors import Planned, Planner
from colibrid.convert.gguf_vocab import PRE_TOKENIZERS, add_tokenizer
from colibrid.convert.writer import fsync_dir, write_atomic
from colibrid.errors import ColibriError, ConvertError
from colibrid.store.checkpoint import Checkpoint

EXPORTER_VERSION = 1
INSTALL = "the gguf package is missing: pip install 'gguf>=0.10' (a dependency of colibri)"
Progress = Callable[[int, int], None]  # (bytes written so far, total bytes)


@dataclass(frozen=True)
class ExportOptions:
    split_max_bytes: int = 0  # 0: one file
    tokenizer: bool = True
    tokenizer_pre: str | None = None

    def to_json(self) -> dict:
        return {
            "split_max_bytes": self.split_max_bytes,
            "tokenizer": self.tokenizer,
            "tokenizer_pre": self.tokenizer_pre,
        }


@dataclass
class ExportResult:
    files: list[Path]
    total_bytes: int
    written_bytes: int
    seconds: float
    notes: list[str]


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ConvertError(INSTALL) from None
    return gguf


# ---- shards --------------------------------------------------------------------------


def shard_paths(out: Path, n: int) -> list[Path]:
    """llama.cpp's split names: ``NAME-00001-of-00003.gguf`` beside OUT (OUT itself if 1)."""
    if n == 1:
        return [out]
    fmt = _gguf().SHARD_NAME_FORMAT
    return [out.with_name(fmt.format(out.stem, i + 1, n)) for i in range(n)]


def split(tensors: list[Planned], max_bytes: int) -> list[list[Planned]]:
    """Consecutive tensors packed into shards of at most ``max_bytes`` of data (a tensor
    larger than that gets a shard of its own); one shard when ``max_bytes`` is 0."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for t in tensors:
        if max_bytes and shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _write_shard(
    path: Path,
    arch: str,
    tensors: list[Planned],
    keys: Callable[[Any], None] | None,
    split_of: tuple[int, int, int] | None,
    progress: Callable[[int], None],
) -> int:
    """One GGUF file: keys (the first shard), split keys, tensor infos, then the data."""
    gguf = _gguf()
    tmp = path.with_name(f".{path.name}.partial")
    w = gguf.GGUFWriter(None, arch)
    if keys is not None:
        keys(w)
    if split_of is not None:
        no, count, total = split_of
        w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, no)
        w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, count)
        w.add_int32(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, total)
    for t in tensors:
        dtype = np.dtype(np.float32 if t.ggml == "F32" else np.uint8)
        raw = None if t.ggml == "F32" else gguf.GGMLQuantizationType[t.ggml]
        w.add_tensor_info(t.name, t.shape, dtype, t.nbytes, raw)
    try:
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in tensors:
            data = t.make()
            if data.shape != t.shape:
                raise ConvertError(f"{t.name}: made {data.shape}, planned {t.shape}")
            w.write_tensor_data(data)
            progress(t.nbytes)
        w.close()
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        w.close()
        tmp.unlink(missing_ok=True)
        raise ConvertError(f"writing {path}: {exc.strerror or exc}") from None
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path.stat().st_size


# ---- resume marker -------------------------------------------------------------------


def marker_path(out: Path) -> Path:
    return out.with_name(f".{out.name}.export.json")


def fingerprint(ckpt: Checkpoint) -> list:
    """What identifies the source: each weight file's name, size and mtime, and config."""
    files = [*ckpt.files]
    out = [[f.path.name, f.path.stat().st_size, f.path.stat().st_mtime_ns] for f in files]
    config = ckpt.dir / "config.json"
    out.append(["config.json", config.stat().st_size, config.stat().st_mtime_ns])
    return sorted(out)


def _load_state(out: Path, identity: dict) -> dict:
    marker = marker_path(out)
    if marker.exists():
        try:
            state = json.loads(marker.read_text())
        except (OSError, ValueError):
            raise ConvertError(f"{marker}: unreadable; remove it to start over") from None
        for key, want in identity.items():
            if state.get(key) != want:
                raise ConvertError(
                    f"{out}: an export with a different {key} is under way there "
                    f"(its marker {marker.name}); use another OUT or the same source and options"
                )
        return state
    if out.exists():
        raise ConvertError(f"{out}: exists and is not an export colibri started; remove it first")
    return {**identity, "shards": {}, "complete": False}


def _save_state(out: Path, state: dict) -> None:
    write_atomic(marker_path(out), (json.dumps(state, indent=1, sort_keys=True) + "\n").encode())


# ---- the export ----------------------------------------------------------------------


def _keys(fam: Family, cfg: dict, folder: Path, options: ExportOptions, notes: list[str]):  # noqa: ANN202
    def add(w: Any) -> None:
        w.add_name(folder.name)
        fam.metadata(w, cfg)
        w.add_file_type(_gguf().LlamaFileType.GUESSED)
        w.add_quantization_version(_gguf().GGML_QUANT_VERSION)
        if options.tokenizer:
            line = add_tokenizer(w, folder, cfg, options.tokenizer_pre)
        else:
            w.add_tokenizer_model("none")
            line = "tokenizer left out (--no-tokenizer): the GGUF takes token ids only"
        if line not in notes:
            notes.append(line)

    return add


def plan(ckpt: Checkpoint) -> tuple[Family, dict, list[Planned]]:
    """The family, config and every GGUF tensor of an open checkpoint."""
    from colibrid.engine.validate import validate

    cfg = dict(ckpt.config)
    fam = family_of(cfg)
    _, expected, _, _ = validate(ckpt)
    return fam, cfg, Planner(ckpt, fam, cfg).plan(expected)


def export(
    model: Path,
    out: Path,
    progress: Progress | None = None,
    options: ExportOptions | None = None,
    say: Callable[[str], object] | None = None,
) -> Path:
    """Export ``model`` to ``out`` (resuming an interrupted export there); returns the
    first file (the one llama.cpp is given)."""
    return run(model, out, options or ExportOptions(), progress, say).files[0]


def run(
    model: Path,
    out: Path,
    options: ExportOptions,
    progress: Progress | None = None,
    say: Callable[[str], object] | None = None,
) -> ExportResult:
    _gguf()
    started = time.perf_counter()
    out = Path(out)
    if not out.parent.is_dir():
        raise ConvertError(f"{out.parent}: no such directory")
    notes: list[str] = []
    with Checkpoint.open(model) as ckpt:
        fam, cfg, tensors = plan(ckpt)
        notes += [t.note for t in tensors if t.note]
        shards = split(tensors, options.split_max_bytes)
        paths = shard_paths(out, len(shards))
        identity = {
            "exporter": EXPORTER_VERSION,
            "options": options.to_json(),
            "source": fingerprint(ckpt),
        }
        state = _load_state(out, identity)
        for stale in out.parent.glob(f".{out.stem}*.partial"):
            stale.unlink(missing_ok=True)
        total = sum(t.nbytes for t in tensors)
        done = state["shards"]
        finished = {p.name for p in paths if p.is_file() and done.get(p.name) == p.stat().st_size}
        sent = sum(
            t.nbytes for p, s in zip(paths, shards, strict=True) if p.name in finished for t in s
        )
        if not state["complete"]:
            _save_state(out, state)
        written = 0
        for i, (path, shard) in enumerate(zip(paths, shards, strict=True)):
            if path.name in finished:
                continue
            need = sum(t.nbytes for t in shard)
            check_disk(out.parent, need, path.name)

            def step(n: int) -> None:
                nonlocal sent, written
                sent += n
                written += n
                if progress is not None:
                    progress(sent, total)

            keys = _keys(fam, cfg, ckpt.dir, options, notes) if i == 0 else None
            split_of = (i, len(shards), len(tensors)) if len(shards) > 1 else None
            done[path.name] = _write_shard(path, fam.arch, shard, keys, split_of, step)
            _save_state(out, state)
            if say is not None:
                say(f"{path.name}: {len(shard)} tensors, {need / 1e9:.3f} GB")
        state["complete"] = True
        _save_state(out, state)
    return ExportResult(paths, total, written, time.perf_counter() - started, notes)


# ---- command line --------------------------------------------------------------------

SIZE = re.compile(r"^(\d+(?:\.\d+)?)([KMG]?)B?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``500M``, ``2G``, ``1.5G`` or a byte count -> bytes (powers of 1000, as llama.cpp's
    gguf-split counts them)."""
    m = SIZE.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500M, 2G)")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2).upper()]
    value = int(float(m.group(1)) * scale)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--split-max-size must be positive, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri export",
        description="Write an installed model or a container folder as a GGUF file that "
        "llama.cpp (llama-server, rpc-server) loads: the stored blocks re-encoded without "
        "requantising, llama.cpp's tensor names and keys, the tokenizer and chat template. "
        "Re-running the same command resumes an interrupted export.",
    )
    p.add_argument("model", metavar="MODEL", help="an installed model name or a folder")
    p.add_argument("--gguf", metavar="OUT", required=True, help="the GGUF file to write")
    p.add_argument(
        "--split-max-size",
        metavar="SIZE",
        type=parse_size,
        default=0,
        help="cut into shards of at most SIZE of tensor data (e.g. 2G), named "
        "OUT-00001-of-0000N.gguf; llama.cpp loads them from the first (default: one file)",
    )
    p.add_argument(
        "--tokenizer-pre",
        metavar="NAME",
        help="byte-level BPE tokenizers only: llama.cpp's name of the pre-tokenizer when "
        "colibri cannot tell it from tokenizer.json (known: "
        f"{', '.join(sorted(set(PRE_TOKENIZERS.values())))}); a SentencePiece-style one "
        "needs none",
    )
    p.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="leave the tokenizer out: the GGUF then takes token ids only",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str]) -> int:
    a = build_parser().parse_args(list(argv))
    from colibrid.config import resolve_model
    from colibrid.paths import Paths

    options = ExportOptions(a.split_max_size, not a.no_tokenizer, a.tokenizer_pre)
    bar = make_progress_bar(0, 0, a.quiet, desc="export")  # its total comes with the plan

    def progress(sent: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.n = sent
            bar.refresh()

    say = (lambda line: None) if a.quiet else (lambda line: print(line, file=sys.stderr))
    try:
        model = resolve_model(Paths.from_env(None), a.model)
        r = run(model, Path(a.gguf), options, progress, say)
    except ColibriError as exc:
        print(f"colibri export: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    for note in r.notes:
        print(f"colibri export: note: {note}", file=sys.stderr)
    state = "already complete" if r.written_bytes == 0 else f"{r.seconds:.1f} s"
    names = (
        r.files[0].name if len(r.files) == 1 else f"{r.files[0].name} .. ({len(r.files)} shards)"
    )
    print(f"{r.files[0].parent}/{names}: {r.total_bytes / 1e9:.3f} GB of tensors ({state})")
    return 0
