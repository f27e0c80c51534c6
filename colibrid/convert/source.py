"""The source checkpoint of a conversion, read row block by row block as float32.

Why row blocks: a conversion must run in bounded memory on checkpoints far larger than
RAM, and the largest single tensors (embeddings, lm_head: 154,880 x 6144) are several GB
in f32. Every supported encoding is decoded here one block of rows at a time; the
quantiser works per row (or per group inside a row), so block-wise conversion is
bit-identical to whole-tensor conversion.

Encodings: F32, BF16, F16, FP8 e4m3 with a ``<name>_scale_inv`` grid of 128x128 block
scales (HF / DeepSeek), NVFP4 (modelopt, see :mod:`colibrid.convert.nvfp4`). The
auxiliary scale tensors are consumed with their weight and not listed. gpt-oss's fused
expert tensors (float or MXFP4, :mod:`colibrid.convert.gpt_oss`) are listed as the
per-expert matrices they hold. Anything else is refused by name before any output is
written.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibrid.convert import gpt_oss, nvfp4
from colibrid.errors import ColibriError, ConvertError
from colibrid.formats import quant
from colibrid.formats.weights import QuantWeight
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.checkpoint_files import CONFIG_NAME

ROW_BLOCK_ELEMENTS = 1 << 22
KNOWN = ("F32", "BF16", "F16", "F8_E4M3")


@dataclass(frozen=True)
class SourceTensor:
    name: str
    shape: tuple[int, ...]  # logical shape (NVFP4: unpacked)
    kind: str  # f32, bf16, f16, fp8, nvfp4, mxfp4
    fused: gpt_oss.FusedTensor | None = None  # a gpt-oss expert matrix: read from here
    index: int = 0  # its place in fused.names()


class Source:
    """An opened source folder; ``tensors`` lists the logical tensors to convert."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self.dir = ckpt.dir
        self.config = ckpt.config
        self.tensors = self._classify()

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Source:
        root = Path(path)
        if not root.is_dir():
            raise ConvertError(f"{root}: source checkpoint folder not found")
        if not (root / CONFIG_NAME).is_file():
            raise ConvertError(
                f"{root}: no config.json (a source needs config.json, "
                "safetensors shards and tokenizer files)"
            )
        try:
            return cls(Checkpoint.open(root))
        except ConvertError:
            raise
        except ColibriError as exc:
            raise ConvertError(str(exc)) from None

    def fingerprint(self) -> list[list[object]]:
        """Name and size of every source file: a resumed run must read the same source."""
        return [[f.path.name, f.size] for f in self.ckpt.files]

    def _classify(self) -> list[SourceTensor]:
        ck = self.ckpt
        names = ck.names()
        aux: set[str] = set()
        found: list[SourceTensor] = []
        fused = gpt_oss.find_fused(names, lambda n: (ck.info(n).shape, ck.info(n).dtype))
        for f in fused:
            if f.kind not in ("mxfp4", "f32", "bf16", "f16"):
                raise ConvertError(f"tensor {f.name!r}: fused experts in {f.kind.upper()}")
            aux.update(f.stored)
            found.extend(
                SourceTensor(name, f.matrix_shape, f.kind, f, i) for i, name in enumerate(f.names())
            )
        for name in names:
            info = ck.info(name)
            if info.dtype == "F8_E4M3" and ck.has(name + "_scale_inv"):
                aux.add(name + "_scale_inv")
            if info.dtype == "U8" and ck.has(name + nvfp4.SCALE_SUFFIX):
                aux.update({name + nvfp4.SCALE_SUFFIX, name + nvfp4.GLOBAL_SUFFIX})
                prefix = name.rsplit(".", 1)[0]
                aux.add(f"{prefix}.{nvfp4.INPUT_SUFFIX}")
        for name in names:
            if name in aux:
                continue
            info = ck.info(name)
            if info.dtype == "U8" and ck.has(name + nvfp4.SCALE_SUFFIX):
                found.append(self._nvfp4_tensor(name))
            elif info.dtype == "U8" and ck.has(name + ".qs"):
                raise ConvertError(
                    f"tensor {name!r}: source is already a colibri container "
                    "(U8 + .qs); convert from the original checkpoint"
                )
            elif info.dtype == "F8_E4M3":
                if len(info.shape) != 2 or not ck.has(name + "_scale_inv"):
                    raise ConvertError(
                        f"tensor {name!r}: FP8 weight without a 2-D "
                        f"{name}_scale_inv block-scale grid"
                    )
                grid = tuple(-(-d // quant.FP8_BLOCK) for d in info.shape)
                sinfo = ck.info(name + "_scale_inv")
                if sinfo.shape != grid or sinfo.dtype not in ("F32", "BF16"):
                    raise ConvertError(
                        f"tensor {name!r}_scale_inv: {sinfo.dtype} "
                        f"{list(sinfo.shape)}, expected F32 {list(grid)}"
                    )
                found.append(SourceTensor(name, info.shape, "fp8"))
            elif info.dtype in KNOWN:
                found.append(SourceTensor(name, info.shape, info.dtype.lower()))
            else:
                raise ConvertError(
                    f"tensor {name!r}: dtype {info.dtype} is not one the converter knows "
                    "(F32, BF16, F16, F8_E4M3 + weight_scale_inv, NVFP4)"
                )
        return found

    def _nvfp4_tensor(self, name: str) -> SourceTensor:
        ck = self.ckpt
        info, sinfo = ck.info(name), ck.info(name + nvfp4.SCALE_SUFFIX)
        if len(info.shape) != 2:
            raise ConvertError(f"tensor {name!r}: NVFP4 weight must be 2-D, got {list(info.shape)}")
        out_f, half = info.shape
        cols = 2 * half
        want = (out_f, -(-cols // nvfp4.BLOCK))
        if sinfo.dtype != "F8_E4M3" or sinfo.shape != want:
            raise ConvertError(
                f"tensor {name + nvfp4.SCALE_SUFFIX!r}: {sinfo.dtype} "
                f"{list(sinfo.shape)}, expected F8_E4M3 {list(want)}"
            )
        gname = name + nvfp4.GLOBAL_SUFFIX
        if not ck.has(gname) or ck.info(gname).dtype != "F32" or ck.info(gname).numel != 1:
            raise ConvertError(f"tensor {name!r}: NVFP4 weight without an F32 scalar {gname!r}")
        nvfp4.check_global(gname, float(ck.array(gname).reshape(-1)[0]))
        return SourceTensor(name, (out_f, cols), "nvfp4")

    # ---- reading ------------------------------------------------------------------

    def row_step(self, t: SourceTensor) -> int:
        cols = t.shape[-1] if t.shape else 1
        step = max(1, ROW_BLOCK_ELEMENTS // max(1, cols))
        if t.kind == "fp8":
            step = max(quant.FP8_BLOCK, step // quant.FP8_BLOCK * quant.FP8_BLOCK)
        return step

    def fp4(self, t: SourceTensor) -> QuantWeight:
        """An MXFP4 expert matrix as it is stored (codes and e8m0 scales, no decoding)."""
        if t.fused is None or t.fused.kind != "mxfp4":
            raise ValueError("not an MXFP4 matrix")
        weight = gpt_oss.expert_fp4(t.fused, t.index, self.ckpt.array)
        for stored in t.fused.stored:  # an expert's slice is contiguous: done with it
            self.release(stored)
        return weight

    def rows(self, t: SourceTensor) -> Iterator[np.ndarray]:
        """The tensor as float32 row blocks (a 1-D/0-D tensor comes as one block)."""
        ck = self.ckpt
        name = t.name
        try:
            if t.fused is not None:  # one expert matrix at a time: bounded memory
                matrix = gpt_oss.expert_matrix(t.fused, t.index, ck.array, _to_f32)
                step = self.row_step(t)
                for r0 in range(0, t.shape[0], step):
                    yield self._finite(name, matrix[r0 : r0 + step])
                for stored in t.fused.stored:  # an expert's slice is contiguous: done with it
                    self.release(stored)
                return
            if len(t.shape) != 2:
                yield self._finite(name, _to_f32(ck.array(name), t.kind))
                return
            step = self.row_step(t)
            raw = ck.array(name)
            if t.kind == "fp8":
                scale = ck.array(name + "_scale_inv")
                if ck.info(name + "_scale_inv").dtype == "BF16":
                    scale = quant.bf16_to_f32(scale)
            elif t.kind == "nvfp4":
                scale = ck.array(name + nvfp4.SCALE_SUFFIX)
                glob = nvfp4.check_global(
                    name, float(ck.array(name + nvfp4.GLOBAL_SUFFIX).reshape(-1)[0])
                )
            for r0 in range(0, t.shape[0], step):
                r1 = r0 + step
                if t.kind == "fp8":
                    block = quant.dequantize_fp8_blocks(raw[r0:r1], scale[r0 // quant.FP8_BLOCK :])
                elif t.kind == "nvfp4":
                    block = nvfp4.decode_rows(raw[r0:r1], scale[r0:r1], glob)
                else:
                    block = _to_f32(raw[r0:r1], t.kind)
                yield self._finite(name, block)
            self.release(name)
        except ConvertError:
            raise
        except ColibriError as exc:
            raise ConvertError(str(exc)) from None

    def release(self, name: str) -> None:
        """Drop this tensor's mapped source pages from our resident set once converted
        (they stay in the page cache): without it a conversion's RSS grows to the
        whole source shard, which looks like (and competes as) real memory use."""
        try:
            f = self.ckpt._file(name)
            info = f.tensors[name]
            page = mmap.PAGESIZE
            start = info.file_begin // page * page
            f._buffer().madvise(mmap.MADV_DONTNEED, start, info.file_end - start)
        except (AttributeError, OSError, ValueError):
            pass  # an optimisation only (no madvise on this platform)

    @staticmethod
    def _finite(name: str, block: np.ndarray) -> np.ndarray:
        if not np.isfinite(block).all():
            raise ConvertError(f"tensor {name!r}: non-finite values in the source")
        return block

    def close(self) -> None:
        self.ckpt.close()


def _to_f32(raw: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bf16":
        return quant.bf16_to_f32(raw)
    return np.asarray(raw, dtype=np.float32)
