"""Which quantised format a colibri container weight holds, from its sizes and stamps.

Why this module exists: upstream colibri containers carry no format ordinal. A quantised
weight is a U8 tensor ``name`` plus a scales tensor ``name.qs`` (F32; FP4's F8_E8M0 scale
bytes; the low-bit affine formats' F16 pairs), and its format follows
from byte arithmetic against the logical [O, I] (docs/formats.md), with
an optional container-wide ``colibri.fmt`` stamp map and ``colibri.group_size`` hint in
``__metadata__``. The checkpoint reader, the validator and the converter (which must
write containers this inference reads back unambiguously) all share these rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibrid.errors import CheckpointError
from colibrid.formats import quant
from colibrid.formats.affine import AFFINE_GROUP, affine_groups, affine_row_bytes
from colibrid.formats.weights import WeightFormat
from colibrid.store.safetensors_file import SafetensorsFile
from colibrid.store.strict_json import describe, load_json_object

MAX_STAMPS = 4096
"""Upstream caps the container-wide ``colibri.fmt`` stamp map at 4096 entries."""

STAMP_KEY = "colibri.fmt"
GROUP_SIZE_KEY = "colibri.group_size"
GROUP_SIZES = tuple(1 << k for k in range(4, 13))  # 16 .. 4096

INT8_ROW = "int8-row"
INT4_ROW = "int4-row"
INT4_GROUPED = "int4-grouped"
FP8_B128 = "fp8-e4m3-b128"
# MXFP4 as stored: e2m1 codes two a byte and one e8m0 byte per 32 inputs (F8_E8M0 scales,
# which no other format has at these sizes). Not upstream's "mxfp4" (fmt 7, Vulkan only).
FP4_E2M1 = "fp4-e2m1-g32"
# Low-bit affine codes for cold experts (formats.affine): a block of 16 (2-bit) or 24
# (3-bit) bytes per 64 inputs and a float16 (scale, minimum) pair per group (F16 scales,
# which no other format has).
INT2_AFFINE = "int2-affine-g64"
INT3_AFFINE = "int3-affine-g64"
AFFINE_CONTAINER = {INT2_AFFINE: WeightFormat.Q2, INT3_AFFINE: WeightFormat.Q3}
SUPPORTED_FORMATS = (INT8_ROW, INT4_ROW, INT4_GROUPED, FP8_B128, FP4_E2M1, INT2_AFFINE, INT3_AFFINE)
KNOWN_UNSUPPORTED = ("f32", "int2-row", "int3-g64", "e8-iq3-lattice", "mxfp4", "int4-rans256-g0")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ContainerFormat:
    """What a ``name`` + ``name.qs`` pair holds, deduced from byte arithmetic."""

    name: str  # one of SUPPORTED_FORMATS
    group_size: int = 0


def _group_size_for(in_features: int, groups: int, hint: int | None) -> int | None:
    """The group size gs with ceil(I/gs) == groups.

    A ``colibri.group_size`` hint wins when it fits. Otherwise powers of two 16..4096 are
    tried; for groups >= 2 at most one power of two can fit (ceil(x) == ceil(x/2) only
    for x <= 1), so 64-first-then-smallest only matters for hand-made inputs.
    """
    if hint is not None and _ceil_div(in_features, hint) == groups:
        return hint
    fits = [gs for gs in GROUP_SIZES if _ceil_div(in_features, gs) == groups]
    if 64 in fits:
        return 64
    return fits[0] if fits else None


def container_candidates(
    shape: tuple[int, int], nbytes: int, n_scales: int, scale_dtype: str, hint: int | None
) -> list[ContainerFormat]:
    """Every supported format whose sizes match, in upstream's preference order.

    Known collisions and how they resolve without a stamp: I == 1 makes int8-row and
    int4-row byte-identical (int8-row wins); small shapes make int8-row and fp8-e4m3-b128
    identical (int8-row wins, as upstream's "INVERSION" rule). A grouped int4 tensor whose
    single group spans the row is reported as int4-row: the arithmetic is the same.
    """
    out_f, in_f = shape
    q4_bytes = out_f * quant.q4_row_bytes(in_f)
    found: list[ContainerFormat] = []
    if scale_dtype == "F32":
        if nbytes == out_f * in_f and n_scales == out_f:
            found.append(ContainerFormat(INT8_ROW))
        if nbytes == q4_bytes and n_scales == out_f:
            found.append(ContainerFormat(INT4_ROW))
        if nbytes == q4_bytes and n_scales % out_f == 0 and n_scales // out_f > 1:
            gs = _group_size_for(in_f, n_scales // out_f, hint)
            if gs is not None:
                found.append(ContainerFormat(INT4_GROUPED, gs))
    if (
        scale_dtype == "F8_E8M0"
        and nbytes == q4_bytes
        and n_scales == out_f * _ceil_div(in_f, quant.FP4_GROUP)
    ):
        found.append(ContainerFormat(FP4_E2M1, quant.FP4_GROUP))
    if scale_dtype == "F16" and n_scales == out_f * 2 * affine_groups(in_f):
        for name, wf in AFFINE_CONTAINER.items():
            if nbytes == out_f * affine_row_bytes(wf, in_f):
                found.append(ContainerFormat(name, AFFINE_GROUP))
    fp8_scales = _ceil_div(out_f, quant.FP8_BLOCK) * _ceil_div(in_f, quant.FP8_BLOCK)
    if scale_dtype in ("F32", "F8_E8M0") and nbytes == out_f * in_f and n_scales == fp8_scales:
        found.append(ContainerFormat(FP8_B128))
    return found


def resolve_container_format(
    tensor: str,
    shape: tuple[int, int],
    nbytes: int,
    n_scales: int,
    scale_dtype: str,
    *,
    stamp: str | None = None,
    hint: int | None = None,
) -> ContainerFormat:
    """Pick the format of a container weight, trust-verify-refuse on a stamp.

    A ``colibri.fmt`` stamp must name a format the sizes allow (it then also breaks
    ties); a stamp naming something else, or a format we cannot decode, is refused.
    """
    found = container_candidates(shape, nbytes, n_scales, scale_dtype, hint)
    if stamp is not None:
        if stamp not in SUPPORTED_FORMATS:
            kind = "unsupported" if stamp in KNOWN_UNSUPPORTED else "unknown"
            raise CheckpointError(
                f"tensor {describe(tensor)}: stamped format {describe(stamp, 40)} is {kind}"
            )
        for cand in found:
            if cand.name == stamp or (stamp == INT4_GROUPED and cand.name == INT4_ROW):
                return cand
        inferred = found[0].name if found else "nothing"
        raise CheckpointError(
            f"tensor {describe(tensor)}: stamped {stamp} but its sizes say {inferred}"
        )
    if found:
        return found[0]
    out_f, in_f = shape
    q4 = out_f * quant.q4_row_bytes(in_f)
    raise CheckpointError(
        f"tensor {describe(tensor)}: {nbytes} bytes + {n_scales} {scale_dtype} scales match no "
        f"format for [{out_f}, {in_f}] (int8-row {out_f * in_f}+{out_f}, int4-row {q4}+{out_f}, "
        f"int4-grouped {q4}+{out_f}*ceil({in_f}/gs), fp4 {q4}+{out_f}*ceil({in_f}/32) e8m0, "
        f"int2/int3-affine-g64 {out_f}*16|24*ceil({in_f}/64)+{out_f}*2*ceil({in_f}/64) f16)"
    )


def _collect_stamps(files: list[SafetensorsFile]) -> dict[str, str]:
    """Container-wide ``colibri.fmt`` map; agreeing duplicates fine, conflicts refused."""
    stamps: dict[str, str] = {}
    for f in files:
        raw = f.metadata.get(STAMP_KEY)
        if raw is None:
            continue
        what = f"{f.path}: __metadata__[{STAMP_KEY!r}]"
        mapping = load_json_object(raw.encode("utf-8"), what)
        for tensor, fmt in mapping.items():
            if not isinstance(fmt, str):
                raise CheckpointError(f"{what}: format of {describe(tensor)} is not a string")
            if stamps.setdefault(tensor, fmt) != fmt:
                raise CheckpointError(
                    f"{what}: tensor {describe(tensor)} stamped both "
                    f"{describe(stamps[tensor], 40)} and {describe(fmt, 40)}"
                )
            if len(stamps) > MAX_STAMPS:
                raise CheckpointError(f"{what}: more than {MAX_STAMPS} stamped tensors")
    return stamps
