"""Finding a model directory's config and weight files, and reading small JSON safely.

Why this module exists: which files make up a checkpoint is itself untrusted input.
Weight files are found from ``model.safetensors.index.json`` when present (every file it
names must be a plain relative path inside the directory: no traversal, and must exist
as a regular file), else from all ``*.safetensors`` in the directory
(``model.safetensors``, ``model-0000k-of-0000n``, and upstream colibri's ``out-NNNNN`` /
``out-mtp-NNNNN`` / ``out-idx-NNNNN`` shards). Small JSON files (config, index, the
converter's progress marker) are read with a size cap and never block on a FIFO; a
directory that ``colibri convert`` has not finished is refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from colibrid.errors import CheckpointError, ColibriError
from colibrid.store.strict_json import describe, load_json_object

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
CONVERT_PROGRESS_NAME = ".colibri-convert.json"
MAX_JSON_FILE_BYTES = 64 * 1024 * 1024


def read_small_file(path: Path, what: str, error: type[ColibriError]) -> bytes:
    """Read a small regular file (JSON) with a size cap, never blocking on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except (OSError, ValueError) as exc:
        raise error(f"{path}: cannot open {what} ({getattr(exc, 'strerror', exc)})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: {what} is not a regular file")
        if st.st_size > MAX_JSON_FILE_BYTES:
            raise error(f"{path}: {what} is {st.st_size} bytes (cap {MAX_JSON_FILE_BYTES})")
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(MAX_JSON_FILE_BYTES + 1)[:MAX_JSON_FILE_BYTES]
    finally:
        os.close(fd)


def _safe_member(model_dir: Path, fname: object, index: Path) -> Path:
    """A weight-map file name as a path inside ``model_dir`` (lexically: no absolute
    paths, no '..'); symlinks inside the directory are the owner's choice (HF caches)."""
    if not isinstance(fname, str) or not fname or "\x00" in fname:
        raise CheckpointError(f"{index}: bad file name {describe(fname)} in weight_map")
    rel = PurePosixPath(fname)
    if rel.is_absolute() or ".." in rel.parts or fname.startswith("~"):
        raise CheckpointError(f"{index}: file {describe(fname)} points outside the model directory")
    path = model_dir.joinpath(*rel.parts)
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        regular = False
    if not regular:
        raise CheckpointError(f"{index}: file {describe(fname)} in weight_map does not exist")
    return path


def _index_files(model_dir: Path, index: Path) -> tuple[list[Path], dict[str, Path]]:
    doc = load_json_object(read_small_file(index, "index", CheckpointError), str(index))
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: 'weight_map' is missing or not a non-empty object")
    claims: dict[str, Path] = {}
    files: dict[Path, None] = {}
    for tensor, fname in weight_map.items():
        path = _safe_member(model_dir, fname, index)
        claims[tensor] = path
        files.setdefault(path)
    return list(files), claims


def _glob_files(model_dir: Path) -> list[Path]:
    return sorted(
        p for p in model_dir.glob("*.safetensors") if p.is_file() and not p.name.startswith(".")
    )


def _refuse_incomplete_conversion(root: Path) -> None:
    """`colibri convert` marks DST incomplete until its last file is written."""
    progress = root / CONVERT_PROGRESS_NAME
    if not progress.exists():
        return
    raw = read_small_file(progress, "conversion progress file", CheckpointError)
    if load_json_object(raw, str(progress)).get("complete") is not True:
        raise CheckpointError(
            f"{root}: incomplete conversion (re-run the same `colibri convert` to finish it)"
        )
