"""What a container holds: tensor classes, their output formats, and the shard layout.

Why a plan separate from the work: a conversion must be resumable and byte-identical
whether or not it was interrupted, so the whole layout (which tensor goes in which
shard, in which order, at which size) is a pure function of the source's tensor list
and the parameters, computed before a byte is written. The same plan drives the
converter (which quantises source weights) and ``colibri synth`` (which invents them).

Tensor classes (each with its own bit width, docs/formats.md):

=========  ==========================================================  =============
class      tensors                                                     default
=========  ==========================================================  =============
expert     routed experts ``mlp.experts.E.{gate,up,down}_proj``         int4-g64
           (Mixtral: ``block_sparse_moe.experts.E.w{1,3,2}``)
shared     shared experts ``mlp.shared_experts.*``                     int4-g64
attn       attention incl. the DSA indexer's wq_b / wk                 int4-g64
dense      dense MLPs of the first layers                              int4-g64
io         ``embed_tokens`` and ``lm_head``                            int8
mtp        every matrix of the MTP layer(s)                            int8
f32        norms, router (``mlp.gate`` / ``block_sparse_moe.gate`` /      f32
           gpt-oss ``mlp.router``), correction bias, indexer weights_proj,
           gpt-oss's fused expert biases, every 1-D tensor
=========  ==========================================================  =============

A bit width of 32 keeps a class in f32 (useful for exact round-trip tests). Routed
experts may also be 16 (bf16): the compact lossless output for MXFP4 sources such as
gpt-oss, whose e2m1 values times power-of-two block scales bf16 holds exactly and no
int8-per-row or int4 grid does.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

from colibrid.convert.writer import Entry, shard_size
from colibrid.errors import ConvertError
from colibrid.formats import quant
from colibrid.store.container_format import (
    FP4_E2M1,
    GROUP_SIZE_KEY,
    INT4_GROUPED,
    INT4_ROW,
    INT8_ROW,
    STAMP_KEY,
    container_candidates,
)

CONVERTER_VERSION = "colibri-convert 1"
CLASSES = ("expert", "shared", "attn", "dense", "io", "mtp", "f32")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp\.experts\.(\d+)\.(gate|up|down)_proj"
    r"|block_sparse_moe\.experts\.(\d+)\.(w1|w3|w2))\.weight$"
)
# Mixtral's names for an expert's gate, up and down projections.
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight")
# gpt-oss's expert biases [E, 2F] / [E, D]: 2-D, but vectors the engine keeps in f32.
_EXPERT_BIASES = ("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias")

MTP_INT4_WARNING = (
    "refusing an int4 MTP layer: per-row/grouped int4 rounds the embedding half of eh_proj "
    "to ~zero (its column scales differ 20-30x), and draft acceptance collapses from ~60-80% "
    "to 0-4% (upstream #8); keep --mtp-bits 8, or pass --force if you really mean it"
)


@dataclass(frozen=True)
class ConvertParams:
    """Everything that changes a container's bytes; recorded and compared on resume."""

    expert_bits: int = 4
    group_size: int = 64
    io_bits: int = 8
    attn_bits: int = 4
    dense_bits: int = 4
    shared_bits: int = 4
    mtp_bits: int = 8
    shard_bytes: int = 4 * 10**9
    order: str | None = None  # sha256 of the usage profile, None = numeric order
    # MXFP4 experts (gpt-oss): "keep" stores them as they are (FP4: the same 4-bit codes
    # and e8m0 scales, lossless); "convert" turns them into expert_bits like any other
    mxfp4: str = "keep"

    def check(self, *, force: bool = False) -> None:
        for name in (
            "expert_bits",
            "io_bits",
            "attn_bits",
            "dense_bits",
            "shared_bits",
            "mtp_bits",
        ):
            bits = getattr(self, name)
            allowed = (4, 8, 16, 32) if name == "expert_bits" else (4, 8, 32)
            if bits not in allowed:
                raise ConvertError(f"--{name.replace('_', '-')} {bits}: choose from {allowed}")
        if self.group_size != 0 and self.group_size not in tuple(1 << k for k in range(4, 13)):
            raise ConvertError(
                f"--group-size {self.group_size}: use 0 (per row) or a power "
                "of two 16..4096 (64 is the upstream default)"
            )
        if self.shard_bytes < 1 << 16:
            raise ConvertError("--shard-gb must allow at least 64 KiB per shard")
        if self.mtp_bits == 4 and not force:
            raise ConvertError(MTP_INT4_WARNING)
        if self.mxfp4 not in ("keep", "convert"):
            raise ConvertError(f"--mxfp4 {self.mxfp4}: choose keep or convert")

    def bits(self, cls: str) -> int:
        return 32 if cls == "f32" else int(getattr(self, f"{cls}_bits"))

    def to_json(self) -> dict[str, object]:
        return asdict(self)


# ---- classification ----------------------------------------------------------------


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def expert_of(name: str) -> tuple[int, int, str] | None:
    """(layer, expert, proj) for a routed expert matrix name; proj is gate_proj, up_proj
    or down_proj whatever the checkpoint calls it."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    if m.group(2) is not None:
        return int(m.group(1)), int(m.group(2)), m.group(3) + "_proj"
    return int(m.group(1)), int(m.group(4)), _MIXTRAL_PROJ[m.group(5)]


def classify(name: str, shape: Sequence[int], n_layers: int) -> str:
    """The tensor class of ``name`` (see the module table)."""
    if len(shape) != 2:
        return "f32"
    if name.endswith((*_ROUTERS, *_EXPERT_BIASES, "indexer.weights_proj.weight")) or "norm" in name:
        return "f32"
    layer = layer_of(name)
    if layer is not None and layer >= n_layers:
        return "mtp"
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return "io"
    if expert_of(name) is not None:
        return "expert"
    if ".mlp.shared_experts." in name:
        return "shared"
    if ".self_attn." in name:
        return "attn"
    if ".mlp." in name:
        return "dense"
    return "f32"


# ---- output formats ----------------------------------------------------------------


@dataclass(frozen=True)
class OutFormat:
    """How one logical tensor is stored: f32, bf16, int8 per row, int4 (gs 0 = per row),
    or `fp4` (an MXFP4 source's codes and e8m0 scales as they are, 4 bits, gs 32)."""

    bits: int
    group_size: int = 0
    fp4: bool = False

    @property
    def quantised(self) -> bool:
        """Codes plus ``.qs`` scales (int8, int4, fp4), not a plain float tensor."""
        return self.bits in (4, 8)

    @property
    def stamp(self) -> str:
        if self.fp4:
            return FP4_E2M1
        if self.bits == 8:
            return INT8_ROW
        if self.bits == 4:
            return INT4_GROUPED if self.group_size else INT4_ROW
        return "bf16" if self.bits == 16 else "f32"

    def data_entry(self, name: str, shape: tuple[int, ...]) -> Entry:
        if not self.quantised:
            n = 1
            for d in shape:
                n *= d
            return Entry(name, self.stamp.upper(), tuple(shape), self.bits // 8 * n)
        out_f, in_f = shape
        cols = in_f if self.bits == 8 else quant.q4_row_bytes(in_f)
        return Entry(name, "U8", (out_f, cols), out_f * cols)

    def scale_entry(self, name: str, shape: tuple[int, ...]) -> Entry | None:
        if not self.quantised:
            return None
        out_f, in_f = shape
        groups = quant.n_groups(in_f, self.group_size if self.bits == 4 else 0)
        if self.fp4:  # one e8m0 byte a group
            return Entry(name + ".qs", "F8_E8M0", (out_f, groups), out_f * groups)
        scale_shape = (out_f,) if groups == 1 and self.group_size == 0 else (out_f, groups)
        return Entry(name + ".qs", "F32", scale_shape, 4 * out_f * groups)


FP4_FORMAT = OutFormat(4, quant.FP4_GROUP, fp4=True)


def out_format(cls: str, shape: Sequence[int], params: ConvertParams) -> OutFormat:
    bits = params.bits(cls)
    if len(shape) != 2:
        bits = 32
    return OutFormat(bits, params.group_size if bits == 4 else 0)


# ---- groups and shards -------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One logical tensor to write: source name == output name, its class and format."""

    name: str
    shape: tuple[int, ...]
    cls: str
    fmt: OutFormat


@dataclass
class Group:
    """Tensors written back to back: one tensor (data then scales) or one routed expert
    (down, gate, up data, then their scales) — the unit a shard never splits."""

    items: list[Item]
    mtp: bool = False
    entries: list[Entry] = field(default_factory=list)

    def __post_init__(self) -> None:
        data = [it.fmt.data_entry(it.name, it.shape) for it in self.items]
        scales = [it.fmt.scale_entry(it.name, it.shape) for it in self.items]
        self.entries = data + [s for s in scales if s is not None]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


@dataclass
class Shard:
    name: str
    groups: list[Group]
    metadata: dict[str, str]

    @property
    def entries(self) -> list[Entry]:
        return [e for g in self.groups for e in g.entries]

    @property
    def nbytes(self) -> int:
        return shard_size(self.entries, self.metadata)


ExpertOrder = Callable[[int, list[int]], list[int]]


def _numeric(layer: int, experts: list[int]) -> list[int]:
    return sorted(experts)


def build_groups(
    tensors: Sequence[tuple[str, tuple[int, ...]]],
    n_layers: int,
    params: ConvertParams,
    order: ExpertOrder | None = None,
    fp4: frozenset[str] = frozenset(),
) -> list[Group]:
    """Group and order the logical tensors: globals, then per layer its non-expert
    tensors by name and its experts in numeric (or profile) order; MTP layers flagged.
    The tensors named in `fp4` are kept in FP4 (MXFP4 sources)."""
    order = order or _numeric
    singles: dict[int, list[Item]] = {}
    experts: dict[int, dict[int, dict[str, Item]]] = {}
    for name, shape in tensors:
        cls = classify(name, shape, n_layers)
        fmt = FP4_FORMAT if name in fp4 else out_format(cls, shape, params)
        item = Item(name, tuple(shape), cls, fmt)
        ex = expert_of(name)
        if ex is not None:
            experts.setdefault(ex[0], {}).setdefault(ex[1], {})[ex[2]] = item
        else:
            layer = layer_of(name)
            singles.setdefault(-1 if layer is None else layer, []).append(item)
    groups: list[Group] = []
    for layer in sorted(set(singles) | set(experts)):
        mtp = layer >= n_layers
        for item in sorted(singles.get(layer, []), key=lambda it: it.name):
            groups.append(Group([item], mtp))
        by_expert = experts.get(layer, {})
        chosen = order(layer, sorted(by_expert))
        if sorted(chosen) != sorted(by_expert):
            raise ConvertError(f"expert order for layer {layer} is not a permutation")
        for e in chosen:
            projs = by_expert[e]
            if set(projs) != {"down_proj", "gate_proj", "up_proj"}:
                raise ConvertError(
                    f"layer {layer} expert {e}: needs gate/up/down_proj, has {sorted(projs)}"
                )
            groups.append(Group([projs[p] for p in ("down_proj", "gate_proj", "up_proj")], mtp))
    return groups


def shard_metadata(groups: Sequence[Group], params: ConvertParams) -> dict[str, str]:
    """``colibri.group_size`` plus ``colibri.fmt`` stamps for the tensors whose byte sizes
    alone would be read as another format (keeps the map far below upstream's 4096 cap)."""
    stamps: dict[str, str] = {}
    hint = params.group_size or None
    for g in groups:
        for it in g.items:
            if not it.fmt.quantised:
                continue
            data = it.fmt.data_entry(it.name, it.shape)
            scales = it.fmt.scale_entry(it.name, it.shape)
            assert scales is not None
            n_scales = math.prod(scales.shape)
            found = container_candidates(it.shape, data.nbytes, n_scales, scales.dtype, hint)
            if len(found) != 1 or found[0].name != it.fmt.stamp:
                if not (
                    it.fmt.stamp == INT4_GROUPED
                    and found
                    and found[0].name == INT4_ROW
                    and len(found) == 1
                ):
                    stamps[it.name] = it.fmt.stamp
    meta = {"format": "pt", "colibri.converter": CONVERTER_VERSION}
    if params.group_size:
        meta[GROUP_SIZE_KEY] = str(params.group_size)
    if stamps:
        meta[STAMP_KEY] = json.dumps(stamps, sort_keys=True, separators=(",", ":"))
    return meta


def pack_shards(groups: Sequence[Group], params: ConvertParams) -> list[Shard]:
    """Greedy packing in plan order; a shard holds at least one group, never splits one.
    Main layers go to ``out-NNNNN``, MTP layers to ``out-mtp-NNNNN`` (upstream names)."""
    shards: list[Shard] = []
    for mtp, prefix in ((False, "out"), (True, "out-mtp")):
        packs: list[list[Group]] = []
        size = 0
        for g in (g for g in groups if g.mtp == mtp):
            if not packs or (packs[-1] and size + g.nbytes > params.shard_bytes):
                packs.append([])
                size = 0
            packs[-1].append(g)
            size += g.nbytes
        for count, pack in enumerate(packs):
            name = f"{prefix}-{count:05d}.safetensors"
            shards.append(Shard(name, pack, shard_metadata(pack, params)))
    return shards


def iter_items(shards: Sequence[Shard]) -> Iterator[Item]:
    for s in shards:
        for g in s.groups:
            yield from g.items
