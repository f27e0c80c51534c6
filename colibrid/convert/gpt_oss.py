"""gpt-oss's fused expert tensors as the per-expert matrices colibri stores.

transformers keeps a layer's experts in two fused tensors: ``mlp.experts.gate_up_proj``
[E, D, 2F] (x @ W, gate at even and up at odd output columns) and ``mlp.experts.down_proj``
[E, F, D]. OpenAI's checkpoints store the same two as MXFP4 in the [out, in] orientation:
``<name>_blocks`` U8 [E, O, I/32, 16] (32 e2m1 values per block, two per byte, the even
element in the low nibble) and ``<name>_scales`` U8 [E, O, I/32] (e8m0: 2^(s - 127) per
block), which transformers' ``integrations/mxfp4.py`` dequantises and transposes to the
fused layout. The expert store reads each expert as three contiguous [O, I] matrices
(``mlp.experts.E.{gate,up,down}_proj.weight``), so the converter transposes (or, from
MXFP4, just slices) and de-interleaves them. The expert biases stay fused (resident,
de-interleaved at load).

A conversion keeps MXFP4 experts as they are by default (FP4: the same codes and e8m0
bytes, `expert_fp4`). Decoded (``--mxfp4 convert``), MXFP4 is exact in float32 and in
bfloat16 (e2m1 has two significant bits, the scale is a power of two), so bf16 or f32
experts (``--bits 16`` / ``32``) keep it too; int8/int4 outputs requantise it.

Why here: the converter and the oracle's checkpoint builder must split the same way.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from colibrid.convert.nvfp4 import E2M1
from colibrid.errors import ConvertError
from colibrid.formats.quant import e8m0_to_f32, fp4_from_mxfp4
from colibrid.formats.weights import QuantWeight

FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
BLOCKS, SCALES = "_blocks", "_scales"
MXFP4_BLOCK = 32


def is_fused(name: str) -> bool:
    return FUSED.match(name) is not None


def _parts(name: str) -> tuple[str, tuple[str, ...]]:
    m = FUSED.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a fused gpt-oss expert tensor")
    projs = ("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else ("down_proj",)
    return m.group(1), projs


def split_names(name: str, n_experts: int) -> list[str]:
    """The per-expert matrix names one fused tensor becomes, expert by expert."""
    prefix, projs = _parts(name)
    return [f"{prefix}.{e}.{p}.weight" for e in range(n_experts) for p in projs]


def split_expert(name: str, fused_e: np.ndarray) -> list[np.ndarray]:
    """One expert's slice of a fused tensor in transformers' layout ([D, 2F] or [F, D]) as
    its [O, I] matrices (views): gate and up [F, D], or down [D, F]."""
    if len(_parts(name)[1]) == 2:
        return [fused_e[:, 0::2].T, fused_e[:, 1::2].T]
    return [fused_e.T]


def split_fused(name: str, fused: np.ndarray) -> dict[str, np.ndarray]:
    """Every per-expert matrix of a fused tensor [E, ...], C-contiguous."""
    names = iter(split_names(name, fused.shape[0]))
    return {
        next(names): np.ascontiguousarray(m)
        for e in range(fused.shape[0])
        for m in split_expert(name, fused[e])
    }


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 rows: blocks U8 [R, G, 16] with scales U8 [R, G] -> float32 [R, G * 32],
    exactly as transformers' convert_moe_packed_tensors (low nibble first)."""
    rows, groups, half = blocks.shape
    vals = np.empty((rows, groups, 2 * half), dtype=np.float32)
    vals[..., 0::2] = E2M1[blocks & 0x0F]
    vals[..., 1::2] = E2M1[blocks >> 4]
    vals *= e8m0_to_f32(scales)[..., None]
    return vals.reshape(rows, groups * 2 * half)


@dataclass(frozen=True)
class FusedTensor:
    """A fused expert tensor of the source: its transformers name, how it is stored
    ("mxfp4" or the float kind of the fused tensor) and the logical [O, I] of each
    per-expert matrix it yields."""

    name: str
    kind: str
    n_experts: int
    matrix_shape: tuple[int, int]

    @property
    def stored(self) -> tuple[str, ...]:
        """The source tensors it is read from."""
        return (self.name + BLOCKS, self.name + SCALES) if self.kind == "mxfp4" else (self.name,)

    def names(self) -> list[str]:
        return split_names(self.name, self.n_experts)


def find_fused(
    names: list[str], shape_of: Callable[[str], tuple[tuple[int, ...], str]]
) -> list[FusedTensor]:
    """The fused expert tensors among a source's tensors; ``shape_of(name)`` gives a stored
    tensor's (shape, dtype). A malformed one is refused by name."""
    present = set(names)
    found: list[FusedTensor] = []
    for name in names:
        base = name.removesuffix(BLOCKS)
        if name.endswith(BLOCKS) and is_fused(base):
            found.append(_mxfp4(base, present, shape_of))
        elif is_fused(name):
            shape, dtype = shape_of(name)
            if len(shape) != 3:
                raise ConvertError(f"tensor {name!r}: fused experts must be 3-D, got {list(shape)}")
            n, i, o = shape
            gate_up = len(_parts(name)[1]) == 2
            if gate_up and o % 2:
                raise ConvertError(f"tensor {name!r}: gate/up width {o} is odd")
            found.append(FusedTensor(name, dtype.lower(), n, (o // 2 if gate_up else o, i)))
    return found


def _mxfp4(base: str, present: set[str], shape_of) -> FusedTensor:
    bshape, bdtype = shape_of(base + BLOCKS)
    if base + SCALES not in present:
        raise ConvertError(f"tensor {base + BLOCKS!r}: MXFP4 blocks without {base + SCALES!r}")
    sshape, sdtype = shape_of(base + SCALES)
    if bdtype != "U8" or len(bshape) != 4 or bshape[3] != MXFP4_BLOCK // 2:
        raise ConvertError(
            f"tensor {base + BLOCKS!r}: {bdtype} {list(bshape)}, expected U8 [E, O, I/32, 16]"
        )
    if sdtype != "U8" or tuple(sshape) != tuple(bshape[:3]):
        raise ConvertError(
            f"tensor {base + SCALES!r}: {sdtype} {list(sshape)}, expected U8 {list(bshape[:3])}"
        )
    n, o, groups, _ = bshape
    gate_up = len(_parts(base)[1]) == 2
    if gate_up and o % 2:
        raise ConvertError(f"tensor {base + BLOCKS!r}: gate/up width {o} is odd")
    return FusedTensor(base, "mxfp4", n, (o // 2 if gate_up else o, groups * MXFP4_BLOCK))


def _mxfp4_slice(
    fused: FusedTensor, index: int, array: Callable[[str], np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """The ``index``-th per-expert matrix's MXFP4 blocks [O, G, 16] and scales [O, G]."""
    per_expert = 2 if len(_parts(fused.name)[1]) == 2 else 1
    expert, part = divmod(index, per_expert)
    blocks = array(fused.name + BLOCKS)[expert]  # [O, G, 16]
    scales = array(fused.name + SCALES)[expert]  # [O, G]
    if per_expert == 2:  # gate rows even, up rows odd
        blocks, scales = blocks[part::2], scales[part::2]
    return np.asarray(blocks), np.asarray(scales)


def expert_fp4(fused: FusedTensor, index: int, array: Callable[[str], np.ndarray]) -> QuantWeight:
    """The ``index``-th per-expert matrix of an MXFP4 tensor kept as stored (FP4): the
    same codes and e8m0 bytes, rows de-interleaved as `expert_matrix`'s."""
    return fp4_from_mxfp4(*_mxfp4_slice(fused, index, array))


def expert_matrix(
    fused: FusedTensor, index: int, array: Callable[[str], np.ndarray], to_f32
) -> np.ndarray:
    """The ``index``-th per-expert matrix of ``fused`` (in ``names()`` order) as float32
    [O, I]; ``array(name)`` reads a stored tensor, ``to_f32(raw, kind)`` decodes floats."""
    per_expert = 2 if len(_parts(fused.name)[1]) == 2 else 1
    expert, part = divmod(index, per_expert)
    if fused.kind == "mxfp4":
        return decode_mxfp4(*_mxfp4_slice(fused, index, array))
    raw = array(fused.name)[expert]  # [I, O]
    if per_expert == 2:
        raw = raw[:, part::2]
    return np.ascontiguousarray(to_f32(np.ascontiguousarray(raw), fused.kind).T)
