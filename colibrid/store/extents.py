"""Byte ranges of each routed expert, coalesced into as few aligned reads as possible.

Why: streaming an expert must cost one (or a few) large reads, not six small ones, and
O_DIRECT needs offset, length and buffer aligned to the device block. This module turns
an expert's tensors (three matrices, plus a ``.qs`` scales tensor each for colibri
containers) into a short list of aligned reads and a recipe for numpy views into the
slab those reads fill — computed once at start-up from safetensors headers only, never
by reading expert data (a GLM-5 container has 19,200 experts).

Checkpoints written by transformers are not expert-contiguous in general (alphabetical
order puts ``experts.10`` between ``experts.1`` and ``experts.2``; safetensors groups
tensors by dtype so U8 data and F32 scales land apart), so an expert may need several
reads; each read covers the aligned superset of a run of adjacent tensors.

Formats whose bytes are not the in-memory weight (FP8, F16: dequantised on load) cannot
be streamed raw; :func:`plan_layer` reports them as :class:`NotStreamable` and the engine
keeps such checkpoints resident.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibrid.store.checkpoint import Checkpoint
from colibrid.store.experts import PROJECTIONS, ExpertLayout, ExpertWeights
from colibrid.store.view_spec import ViewSpec

ALIGN = 4096
"""O_DIRECT alignment used for offsets, lengths and buffers (covers 512 B and 4 KiB
sectors; macOS F_NOCACHE and buffered reads are happy with it too)."""


class NotStreamable(Exception):
    """An expert tensor whose file bytes are not its in-memory form (FP8, F16, ...)."""


def align_down(x: int, a: int = ALIGN) -> int:
    return x - x % a


def align_up(x: int, a: int = ALIGN) -> int:
    return -(-x // a) * a


@dataclass(frozen=True)
class Read:
    """One aligned read: ``length`` bytes at ``offset`` of file ``file`` into the slab at
    ``slab_offset`` (all multiples of ALIGN)."""

    file: int
    offset: int
    length: int
    slab_offset: int


@dataclass(frozen=True)
class ExpertExtents:
    """Reads that fetch one expert and where each tensor then sits in its slab."""

    reads: tuple[Read, ...]
    specs: tuple[ViewSpec, ViewSpec, ViewSpec]
    data_at: tuple[int, int, int]  # slab offsets of gate/up/down data
    scales_at: tuple[int | None, int | None, int | None]
    slab_bytes: int  # aligned bytes the reads fill
    payload_bytes: int  # exact tensor bytes (what the model needs)

    @property
    def read_bytes(self) -> int:
        """Bytes the reads transfer (the aligned supersets)."""
        return sum(r.length for r in self.reads)

    def views(self, slab: np.ndarray) -> ExpertWeights:
        """Zero-copy QuantWeights over a filled slab (uint8, at least slab_bytes long)."""
        mats = []
        for spec, at, s_at in zip(self.specs, self.data_at, self.scales_at, strict=True):
            data = slab[at : at + spec.data_nbytes]
            scales = None if s_at is None else slab[s_at : s_at + spec.scales_nbytes]
            mats.append(spec.build(data, scales))
        return ExpertWeights(*mats)


class ExtentPlanner:
    """Plans every expert of a checkpoint from its headers; the view recipes come from the
    checkpoint (``view_spec``), which opens one matrix per size signature as a weight."""

    def __init__(self, checkpoint: Checkpoint, layout: ExpertLayout) -> None:
        self.checkpoint = checkpoint
        self.layout = layout
        self.files: list[Path] = []
        self._file_index: dict[Path, int] = {}

    def _file(self, name: str) -> int:
        path = self.checkpoint.file_of(name)
        if path not in self._file_index:
            self._file_index[path] = len(self.files)
            self.files.append(path)
        return self._file_index[path]

    def _spec(self, name: str, shape: tuple[int, int]) -> ViewSpec:
        spec = self.checkpoint.view_spec(name, shape)  # checks one matrix per signature
        if spec is None:
            dtype = self.checkpoint.info(name).dtype
            raise NotStreamable(f"{name}: {dtype} experts are converted on load")
        return spec

    def plan(self, layer: int, expert: int, template: str | None = None) -> ExpertExtents:
        ckpt = self.checkpoint
        specs: list[ViewSpec] = []
        ranges: list[tuple[int, int, int, tuple[int, str]]] = []  # file, begin, end, tag
        for i, proj in enumerate(PROJECTIONS):
            name = self.layout.tensor_name(layer, expert, proj, template)
            spec = self._spec(name, self.layout.shape(proj))
            specs.append(spec)
            info = ckpt.info(name)
            ranges.append((self._file(name), info.file_begin, info.file_end, (i, "data")))
            if spec.scales_shape is not None:
                qs = ckpt.info(name + ".qs")
                ranges.append((self._file(name + ".qs"), qs.file_begin, qs.file_end, (i, "scales")))
        ranges.sort()
        reads: list[Read] = []
        placed: dict[tuple[int, str], int] = {}
        cur: list[int] | None = None  # [file, aligned_begin, aligned_end, slab_offset]
        members: list[tuple[int, tuple[int, str]]] = []
        slab = 0

        def flush() -> None:
            nonlocal slab
            if cur is None:
                return
            reads.append(Read(cur[0], cur[1], cur[2] - cur[1], cur[3]))
            for begin, tag in members:
                placed[tag] = cur[3] + begin - cur[1]
            slab = cur[3] + cur[2] - cur[1]

        for f, begin, end, tag in ranges:
            a0, a1 = align_down(begin), align_up(end)
            if cur is not None and f == cur[0] and a0 <= cur[2]:
                cur[2] = max(cur[2], a1)
            else:
                flush()
                cur, members = [f, a0, a1, slab], []
            members.append((begin, tag))
        flush()
        payload = sum(e - b for _, b, e, _ in ranges)
        return ExpertExtents(
            reads=tuple(reads),
            specs=(specs[0], specs[1], specs[2]),
            data_at=(placed[(0, "data")], placed[(1, "data")], placed[(2, "data")]),
            scales_at=tuple(placed.get((i, "scales")) for i in range(3)),  # type: ignore[arg-type]
            slab_bytes=slab,
            payload_bytes=payload,
        )
