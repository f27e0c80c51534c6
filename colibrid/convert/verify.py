"""``colibri inspect --verify``: every byte of a container against its manifest's digests.

Why a whole pass: the daemon checks what it reads (docs/formats.md, "Digests"), but a
damaged expert no request has needed yet, a header byte, or a shard's padding only shows
when every byte is read. Each shard is read once, sequentially, and hashed whole and
tensor by tensor (:func:`colibrid.store.integrity.hash_file`), so a mismatch names the
shard and the tensor. A container whose manifest records no digests (written before
colibri recorded them, or upstream colibri's) has nothing to check against: a note says
so, and it counts as a failure only when asked (``--strict``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from colibrid.errors import CheckpointError
from colibrid.store.checkpoint_files import _glob_files
from colibrid.store.integrity import HASH, Digests, ShardDigest, hash_file, hex64
from colibrid.store.safetensors_file import SafetensorsFile
from colibrid.store.strict_json import describe


@dataclass
class VerifyResult:
    """What a verification found: problems (one line each), counts, and the note."""

    problems: list[str] = field(default_factory=list)
    shards: int = 0
    tensors: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    note: str = ""  # set when there was nothing to check against

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        if self.note:
            return f"verify: note: {self.note}; nothing to check against"
        rate = self.nbytes / self.seconds / 1e9 if self.seconds else 0.0
        head = (
            f"verify: {self.shards} shards, {self.tensors} tensors, {self.nbytes / 1e9:.3f} GB "
            f"read in {self.seconds:.1f} s ({rate:.2f} GB/s, {HASH})"
        )
        if self.ok:
            return head + ": every byte matches its digest"
        return head + f": {len(self.problems)} problem(s)"


def _check_shard(path: Path, want: ShardDigest, result: VerifyResult, progress) -> None:
    """Hash one shard and add a line per tensor (or header) that differs."""
    bad = result.problems.append
    try:
        size = path.stat().st_size
    except OSError as exc:
        bad(f"BAD {path}: cannot read it ({exc.strerror or exc})")
        return
    if size != want.nbytes:
        bad(f"BAD {path}: {size} bytes, the manifest records {want.nbytes}")
    try:
        with SafetensorsFile.open(path) as f:
            ranges = [(t.name, t.file_begin, t.file_end) for t in f.tensors.values()]
    except CheckpointError as exc:  # a damaged header: the whole-file digest still runs
        bad(f"BAD {exc}")
        ranges = []
    whole, got = hash_file(path, ranges, progress)
    result.shards += 1
    result.nbytes += size
    result.tensors += len(got)
    tensor_bad = 0
    for name, value in got.items():
        expected = want.tensors.get(name)
        if expected is None:
            bad(f"BAD {path}: tensor {describe(name)}: not in the manifest (not what was written)")
            tensor_bad += 1
        elif value != expected:
            bad(
                f"BAD {path}: tensor {describe(name)}: {HASH} {hex64(value)}, "
                f"the manifest records {hex64(expected)}"
            )
            tensor_bad += 1
    if ranges:
        for name in sorted(set(want.tensors) - set(got)):
            bad(f"BAD {path}: tensor {describe(name)}: in the manifest, missing from the file")
    if whole != want.file and not tensor_bad and ranges:
        bad(
            f"BAD {path}: header or padding bytes differ from the manifest's whole-file "
            f"digest ({hex64(whole)}, recorded {hex64(want.file)}); every tensor matches"
        )


def verify(path: str | Path, progress: Callable[[int], None] | None = None) -> VerifyResult:
    """Check every shard of the container at ``path`` against its manifest's digests."""
    root = Path(path)
    result = VerifyResult()
    started = time.perf_counter()
    digests, why = Digests.load(root)
    if digests is None:
        result.note = f"{root}: {why}"
        return result
    present = {p.name: p for p in _glob_files(root)}
    for name, want in digests.shards.items():
        shard = root / name
        if name not in present and not shard.is_file():
            result.problems.append(f"BAD {shard}: in the manifest, missing from the folder")
            continue
        _check_shard(shard, want, result, progress)
    for name in sorted(set(present) - set(digests.shards)):
        result.problems.append(f"BAD {present[name]}: not in the manifest (nothing to check)")
    result.seconds = time.perf_counter() - started
    return result


def total_bytes(path: str | Path) -> int:
    """Bytes a verification reads (for a progress bar): every listed shard present."""
    root = Path(path)
    digests, _ = Digests.load(root)
    if digests is None:
        return 0
    return sum(s.nbytes for s in digests.shards.values() if (root / s.name).is_file())


def progress_bar(total: int):  # type: ignore[no-untyped-def]
    """A tqdm bar on a terminal, else None (a pipe gets the result lines only)."""
    if not total or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, desc="verify"
    )
