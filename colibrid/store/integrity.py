"""Weight digests: what a container's writer recorded of every byte, and the reading side.

Why: a flipped bit in an expert matrix, a scale overwritten with a finite 1e30, a block
of zeroed embeddings all load and answer, wrongly, without any other check noticing. The
writers (``colibri convert``, ``pull``, ``synth``, the demo build) hash every tensor and
every whole shard as they write it and record the digests in ``manifest.json``
(docs/formats.md, "Digests"); ``colibri inspect --verify`` and the daemon hold the bytes
they read to them.

Why XXH3-64: the check sits on the streaming path, in the reader threads, so it must be
far faster than the drive and leave the cores to the kernels; XXH3 hashes at memory speed
on one core and the ``xxhash`` binding releases the GIL on large buffers (measured in
docs/performance.md). It guards against corruption (bit rot, a bad copy, a truncated or
edited file), not against someone who can rewrite the manifest as well: that would need a
signed manifest, which is no part of this format. Per tensor, not per file, so a mismatch
names the tensor, and so an expert can be checked from the one read that fetches it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from colibrid.errors import CheckpointError, CorruptWeights
from colibrid.store.checkpoint_files import read_small_file
from colibrid.store.strict_json import describe, load_json_object

HASH = "xxh3-64"
"""The manifest's ``hash``: XXH3, 64 bits, seed 0; digests as 16 lowercase hex digits."""
MANIFEST_NAME = "manifest.json"
READ_CHUNK = 8 << 20


def digest(buf: object) -> int:
    """XXH3-64 of a buffer (bytes, memoryview, C-contiguous numpy array)."""
    return xxhash.xxh3_64_intdigest(buf)  # type: ignore[arg-type]


def hex64(value: int) -> str:
    return f"{value:016x}"


def new_hasher() -> xxhash.xxh3_64:
    """A streaming XXH3-64 (``update`` chunk by chunk, ``intdigest`` at the end)."""
    return xxhash.xxh3_64()


def _parse_hex64(text: object, what: str) -> int:
    if not (isinstance(text, str) and len(text) == 16):
        raise CheckpointError(f"{what}: digest {describe(text, 24)} is not 16 hex digits")
    try:
        return int(text, 16)
    except ValueError:
        raise CheckpointError(f"{what}: digest {describe(text, 24)} is not 16 hex digits") from None


@dataclass(frozen=True)
class ShardDigest:
    """One shard as its writer recorded it: size, whole-file digest, each tensor's."""

    name: str
    nbytes: int
    file: int
    tensors: dict[str, int]

    def manifest_entry(self) -> dict[str, object]:
        return {
            "name": self.name,
            "bytes": self.nbytes,
            "digest": hex64(self.file),
            "tensors": {name: hex64(value) for name, value in self.tensors.items()},
        }

    @classmethod
    def from_entry(cls, entry: object, where: str) -> ShardDigest:
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: a shard entry is not an object")
        name, nbytes, tensors = entry.get("name"), entry.get("bytes"), entry.get("tensors")
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise CheckpointError(f"{where}: bad shard name {describe(name)}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise CheckpointError(f"{where}: shard {name}: bad byte count {describe(nbytes)}")
        if not isinstance(tensors, dict):
            raise CheckpointError(f"{where}: shard {name}: no tensor digests")
        at = f"{where}: shard {name}"
        return cls(
            name,
            nbytes,
            _parse_hex64(entry.get("digest"), at),
            {str(t): _parse_hex64(d, f"{at}: tensor {describe(t)}") for t, d in tensors.items()},
        )


@dataclass(frozen=True)
class Digests:
    """The digests of a container, by shard file name."""

    shards: dict[str, ShardDigest]

    @classmethod
    def load(cls, model_dir: Path) -> tuple[Digests | None, str]:
        """(digests, why there are none): None with a reason for a folder whose manifest
        records no digests (made before digests, upstream colibri's containers, Hugging
        Face checkpoints); a manifest that records them badly is an error."""
        path = Path(model_dir) / MANIFEST_NAME
        if not path.is_file():
            return None, "no manifest.json (not a colibri container, or upstream colibri's)"
        manifest = load_json_object(read_small_file(path, "manifest", CheckpointError), str(path))
        kind = manifest.get("hash")
        if kind is None:
            return None, "its manifest.json records no digests (written before colibri did)"
        if kind != HASH:
            return None, f"its manifest.json records {describe(kind, 24)} digests, not {HASH}"
        entries = manifest.get("shards")
        if not isinstance(entries, list):
            raise CheckpointError(f"{path}: 'shards' is not a list")
        shards: dict[str, ShardDigest] = {}
        for entry in entries:
            shard = ShardDigest.from_entry(entry, str(path))
            if shard.name in shards:
                raise CheckpointError(f"{path}: shard {shard.name} listed twice")
            shards[shard.name] = shard
        return cls(shards), ""

    def expected(self, file: Path, tensor: str) -> int:
        """The recorded digest of ``tensor`` in ``file``; a tensor or file the manifest
        does not know is a mismatch (the file is not what was written)."""
        shard = self.shards.get(file.name)
        if shard is None:
            raise CorruptWeights(f"{file}: this shard is not in the container's manifest.json")
        value = shard.tensors.get(tensor)
        if value is None:
            raise CorruptWeights(
                f"{file}: tensor {describe(tensor)} is not in the manifest's digests of this shard"
            )
        return value


def mismatch(file: Path, tensor: str, got: int, want: int, what: str = "") -> CorruptWeights:
    """The one-line error for a tensor whose bytes differ from its digest."""
    return CorruptWeights(
        f"{file}: tensor {describe(tensor)}{what}: bytes differ from the digest recorded in "
        f"manifest.json ({HASH} {hex64(got)}, recorded {hex64(want)}): the file is damaged; "
        "re-pull or re-convert the model (`colibri inspect --verify` checks all of it)"
    )


def check(file: Path, tensor: str, buf: object, want: int, what: str = "") -> None:
    got = digest(buf)
    if got != want:
        raise mismatch(file, tensor, got, want, what)


def hash_file(
    path: Path, ranges: Sequence[tuple[str, int, int]], progress=None
) -> tuple[int, dict[str, int]]:
    """(whole-file digest, {name: digest}) of ``path`` in one sequential pass; ``ranges``
    are (name, begin, end) byte ranges inside it (tensors). ``progress(nbytes)`` is told
    each chunk read. Pages read are dropped from the page cache behind the pass, so
    checking a model larger than RAM does not evict what the machine was using."""
    order = sorted(ranges, key=lambda r: (r[1], r[2]))
    whole = new_hasher()
    hashers = {name: new_hasher() for name, _, _ in order}
    first = 0  # the first range that may still overlap the read position
    fd = os.open(path, os.O_RDONLY)
    try:
        _advise(fd, "POSIX_FADV_SEQUENTIAL")
        pos = 0
        while True:
            chunk = os.pread(fd, READ_CHUNK, pos)
            if not chunk:
                break
            end = pos + len(chunk)
            whole.update(chunk)
            view = memoryview(chunk)
            while first < len(order) and order[first][2] <= pos:
                first += 1
            for name, begin, stop in order[first:]:
                if begin >= end:
                    break
                lo, hi = max(begin, pos), min(stop, end)
                if lo < hi:
                    hashers[name].update(view[lo - pos : hi - pos])
            if progress is not None:
                progress(len(chunk))
            _advise(fd, "POSIX_FADV_DONTNEED", pos, len(chunk))
            pos = end
    finally:
        os.close(fd)
    return whole.intdigest(), {name: h.intdigest() for name, h in hashers.items()}


def _advise(fd: int, advice: str, offset: int = 0, length: int = 0) -> None:
    flag = getattr(os, advice, None)
    if flag is not None:
        try:
            os.posix_fadvise(fd, offset, length, flag)
        except OSError:
            pass


def file_digests(path: Path, tensors: Iterable[tuple[str, int, int]]) -> ShardDigest:
    """A shard's digests computed from the file (a shard written before its digests were
    kept in the progress file: resuming an older conversion)."""
    ranges = list(tensors)
    whole, per = hash_file(path, ranges)
    return ShardDigest(path.name, path.stat().st_size, whole, per)
