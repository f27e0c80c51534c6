"""The daemon's rule for holding weight bytes to the manifest's digests.

* **Mapped weights, at load.** Every tensor the model reads through the memory map (the
  dense part: attention, dense and shared MLPs, norms, routers, embeddings, head; and the
  routed experts too when the store keeps them all resident) is hashed once when the
  model loads, before any request can use it. One that differs refuses the load, with a
  message naming the shard and the tensor. This reads those bytes once at load (they
  would be read by the first tokens anyway); the cost is in docs/performance.md.
* **Streamed experts, as they are read.** An expert read from disk is hashed in the
  reader thread right after its read, before the read is reported complete
  (:class:`ExpertChecks`), the first time each expert is read in the store's life. A
  mismatch fails that read: the request that waits for it fails with the message, the
  slot is freed, the expert is not cached (nothing answers from those bytes), and the
  next request that needs it reads and checks it again. A failed background read (a
  PILOT guess, a REPIN) costs only itself. Why the first read, not every read: the
  digests guard the file; once an expert's bytes have matched, a later read of the same
  file range returns the same bytes unless the drive fails under it, which its own
  checksums report as an I/O error.
* Tensors of a layer loaded but never run (the MTP layer when not drafting) are not read,
  so not checked. Folders without digests (containers written before colibri recorded
  them, upstream colibri's, Hugging Face checkpoints) load unchecked, with a note in the
  log; ``verify_weights = false`` turns all of this off.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from colibrid.store.checkpoint import Checkpoint
from colibrid.store.experts import PROJECTIONS, ExpertLayout
from colibrid.store.extents import ExpertExtents
from colibrid.store.integrity import Digests, check, digest, mismatch
from colibrid.store.telemetry import Counters

log = logging.getLogger("colibri.store")

LOAD_THREADS = 2  # hashing releases the GIL: one thread hashes while another faults pages in


def load_digests(checkpoint: Checkpoint) -> Digests | None:
    """The container's digests, or None (logged as a note: its weights load unchecked)."""
    digests, why = Digests.load(checkpoint.dir)
    if digests is None:
        log.info("colibri: note: %s: %s; its weights are not checked", checkpoint.dir, why)
    return digests


def check_covered(checkpoint: Checkpoint, digests: Digests, names: Iterable[str]) -> None:
    """Every tensor of ``names`` has a recorded digest (headers only, nothing read): a
    streamed expert whose shard or name the manifest does not know is refused at load,
    not at its first read in the middle of a request."""
    for name in names:
        digests.expected(checkpoint.file_of(name), name)


def verify_mapped(
    checkpoint: Checkpoint, digests: Digests, names: Iterable[str], what: str = "weights"
) -> None:
    """Hash every tensor of ``names`` as mapped and compare it with its digest; the first
    mismatch in file order raises :class:`~colibrid.errors.CorruptWeights` naming its
    shard and tensor."""
    started = time.perf_counter()
    infos = sorted(
        (checkpoint.info(n) for n in names), key=lambda i: (checkpoint.file_of(i.name), i[3])
    )
    jobs = [(checkpoint.file_of(i.name), i.name) for i in infos]
    wants = [digests.expected(path, name) for path, name in jobs]

    def hashed(job: tuple[Path, str]) -> int:
        return digest(checkpoint.raw(job[1]))

    with ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="colibri-verify") as pool:
        for (path, name), want, got in zip(jobs, wants, pool.map(hashed, jobs), strict=True):
            if got != want:
                raise mismatch(path, name, got, want)
    nbytes = sum(i.nbytes for i in infos)
    log.info(
        "colibri: %s checked against their digests: %d tensors, %.3f GB in %.2f s",
        what,
        len(infos),
        nbytes / 1e9,
        time.perf_counter() - started,
    )


class ExpertCheck:
    """One streamed expert's tensors as they sit in its slab, with their digests; called
    by the reader thread on the filled slab."""

    __slots__ = ("ranges", "passed", "label", "owner")

    def __init__(
        self,
        ranges: tuple[tuple[int, int, int, Path, str], ...],
        label: str,
        owner: ExpertChecks,
    ) -> None:
        self.ranges = ranges  # (slab offset, bytes, digest, file, tensor name)
        self.passed = False
        self.label = label
        self.owner = owner

    def __call__(self, slab: memoryview) -> None:
        t0 = time.perf_counter()
        try:
            for at, nbytes, want, path, name in self.ranges:
                check(path, name, slab[at : at + nbytes], want, self.label)
        finally:
            self.owner.count(time.perf_counter() - t0)
        self.passed = True


class ExpertChecks:
    """The check each streamed expert's read carries until one has passed (see the module
    doc for the rule); built lazily per expert from the headers and the manifest."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        digests: Digests,
        layout: ExpertLayout,
        templates: dict[int, str | None],
        extents: dict[int, list[ExpertExtents]],
        stats: Counters,
    ) -> None:
        self.stats = stats  # `checked` and `check_s`, bumped by reader threads
        self._lock = threading.Lock()
        self.checkpoint = checkpoint
        self.digests = digests
        self.layout = layout
        self.templates = templates
        self.extents = extents
        self._checks: dict[tuple[int, int], ExpertCheck] = {}

    def count(self, seconds: float) -> None:
        with self._lock:
            self.stats.checked += 1
            self.stats.check_s += seconds

    def for_read(self, key: tuple[int, int]) -> ExpertCheck | None:
        """The check a read of ``key`` carries; None once the expert has passed one."""
        found = self._checks.get(key)
        if found is None:
            found = self._checks[key] = self._build(key)
        return None if found.passed else found

    def _build(self, key: tuple[int, int]) -> ExpertCheck:
        layer, expert = key
        ext, ckpt = self.extents[layer][expert], self.checkpoint
        ranges = []
        for i, proj in enumerate(PROJECTIONS):
            name = self.layout.tensor_name(layer, expert, proj, self.templates.get(layer))
            parts = [(ext.data_at[i], name)]
            if ext.scales_at[i] is not None:
                parts.append((ext.scales_at[i], name + ".qs"))
            for at, tensor in parts:  # open_store checked every digest is there
                path = ckpt.file_of(tensor)
                want = self.digests.expected(path, tensor)
                ranges.append((at, ckpt.info(tensor).nbytes, want, path, tensor))
        label = f" (expert {expert} of layer {layer}, read from disk)"
        return ExpertCheck(tuple(ranges), label, self)
