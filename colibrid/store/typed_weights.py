"""Typed weights: a checkpoint's tensors as QuantWeight / float32, whatever they are stored as.

Why this module exists: model code asks for ``weight(name, (O, I))`` and gets a
:class:`QuantWeight` in whatever format the files hold (an HF checkpoint in F32, BF16,
F16 or block-scaled FP8, or an upstream colibri container with int8/int4 weights), with
the logical shape it derived from config.json *checked* against the bytes. This is the
dtype conversion half of :class:`~colibrid.store.checkpoint.Checkpoint` (FP8 and F16
dequantisation, BF16 widening, container views), kept apart from finding and indexing
the tensors; ``Checkpoint`` inherits it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from colibrid.errors import CheckpointError, ConfigError
from colibrid.formats import quant
from colibrid.formats.affine import affine_row_bytes
from colibrid.formats.weights import QuantWeight, WeightFormat, WeightLayout
from colibrid.store.container_format import (
    AFFINE_CONTAINER,
    FP4_E2M1,
    FP8_B128,
    GROUP_SIZE_KEY,
    INT4_ROW,
    INT8_ROW,
    ContainerFormat,
    _ceil_div,
    resolve_container_format,
)
from colibrid.store.safetensors_header import TensorInfo
from colibrid.store.strict_json import describe
from colibrid.store.view_spec import ViewSpec, bad_scales

if TYPE_CHECKING:
    from colibrid.store.safetensors_file import SafetensorsFile


class TypedWeights:
    """Typed access over a tensor lookup; mixed into :class:`Checkpoint`, which provides
    ``info``, ``has``, ``array``, ``_file``, ``_fail`` and the ``_stamps`` map."""

    if TYPE_CHECKING:
        _stamps: dict[str, str]
        matrix_layouts: dict[WeightLayout, int]
        matrix_kinds: dict[str, tuple[WeightLayout, int]]
        _views: dict[tuple, ViewSpec | None]
        _formats: dict[tuple, ContainerFormat]

        def info(self, name: str) -> TensorInfo: ...
        def has(self, name: str) -> bool: ...
        def array(self, name: str) -> np.ndarray: ...
        def _file(self, name: str) -> SafetensorsFile: ...
        def _fail(self, name: str, problem: str) -> CheckpointError: ...

    def weight(self, name: str, shape: tuple[int, int]) -> QuantWeight:
        """The matrix ``name`` with logical shape [O, I] (from config), format as stored.

        F32 and BF16 are zero-copy views; F16 and FP8 (HF ``weight_scale_inv``
        convention, 128x128 blocks) come back dequantised to F32; colibri containers
        (``name`` U8 + ``name.qs`` F32) come back as Q8/Q4 views. Each layout handed
        out is noted in ``matrix_layouts`` with its largest row count: what a backend
        tunes its kernels for before the first token (``Ops.prepare``); each matrix's
        layout and bytes are noted by name in ``matrix_kinds``, from which the live
        roofline prices a token's products (serve.kernel_ceiling).

        The first matrix of each size signature goes through every check; later ones of
        the same signature are rebuilt from its :class:`ViewSpec` (their scales are still
        checked one by one): a GLM-5 container has ~60,000 expert matrices.
        """
        out_f, in_f = _matrix_shape(name, shape)
        info, qs, key = self._signature(name, (out_f, in_f))
        spec = self._views.get(key, False)
        if spec:  # its layout and row count are noted already: they are part of the key
            w = self._view(name, qs, spec)
        else:
            w = self._matrix(name, (out_f, in_f))
            if spec is False:
                self._views[key] = _view_of(w, info, qs)
            layouts = self.matrix_layouts
            layouts[w.layout] = max(layouts.get(w.layout, 0), out_f)
        self.matrix_kinds[name] = (w.layout, w.nbytes)
        return w

    def view_spec(self, name: str, shape: tuple[int, int]) -> ViewSpec | None:
        """How the matrix ``name`` [O, I] is rebuilt from its stored bytes (opening it as
        a weight, every check run, the first time its signature is asked for); None when
        the stored bytes are not the weight (F16, FP8: dequantised on load)."""
        _, _, key = self._signature(name, _matrix_shape(name, shape))
        if key not in self._views:
            self.weight(name, shape)
        return self._views[key]

    def _signature(
        self, name: str, shape: tuple[int, int]
    ) -> tuple[TensorInfo, TensorInfo | None, tuple]:
        """``name``'s header record, its scales' (containers), and what every matrix
        handed out the same way shares: dtypes and shapes, stamp and file."""
        info = self.info(name)
        qs = self.info(name + ".qs") if info.dtype == "U8" and self.has(name + ".qs") else None
        key = (
            info[1:3],  # dtype, shape
            shape,
            None if qs is None else qs[1:3],
            self._stamps.get(name),
            self._file(name),  # the group size hint is per file
        )
        return info, qs, key

    def _view(self, name: str, qs: TensorInfo | None, spec: ViewSpec) -> QuantWeight:
        """A matrix whose signature has been checked: views over the mapped bytes."""
        scales = None
        if qs is not None:
            scales = self._file(qs.name).raw(qs.name)
        w = spec.build(self._file(name).raw(name), scales)
        if w.scales is not None:
            problem = bad_scales(w.scales)
            if problem:
                raise self._fail(qs.name if qs is not None else name, problem)
        return w

    def _matrix(self, name: str, shape: tuple[int, int]) -> QuantWeight:
        out_f, in_f = _matrix_shape(name, shape)
        info = self.info(name)
        if info.dtype == "U8":
            if not self.has(name + ".qs"):
                raise self._fail(name, "U8 matrix without its .qs scales")
            return self._container_weight(name, (out_f, in_f))
        if info.dtype not in ("F32", "BF16", "F16", "F8_E4M3"):
            raise self._fail(name, f"dtype {info.dtype} is not supported for a matrix")
        self._expect_shape(info, (out_f, in_f))
        data = self.array(name)
        if info.dtype == "F32":
            return QuantWeight(WeightFormat.F32, (out_f, in_f), data)
        if info.dtype == "BF16":
            return QuantWeight(WeightFormat.BF16, (out_f, in_f), data)
        if info.dtype == "F16":
            return QuantWeight(WeightFormat.F32, (out_f, in_f), data.astype(np.float32))
        return self._fp8_weight(name, data)

    def vector(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 tensor of exactly ``shape`` (norms, biases, router rows).

        F32 is a zero-copy read-only view; BF16 and F16 are converted.
        """
        shape = tuple(shape)
        info = self.info(name)
        self._expect_shape(info, shape)
        data = self.array(name)
        if info.dtype == "F32":
            return data
        if info.dtype == "BF16":
            return quant.bf16_to_f32(data)
        if info.dtype == "F16":
            return data.astype(np.float32)
        raise self._fail(name, f"dtype {info.dtype} is not supported for a float vector")

    def dense_f32(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        """The matrix fully dequantised to float32 [O, I] (read-only view if stored F32)."""
        return quant.dequantize(self.weight(name, shape))

    def _expect_shape(self, info: TensorInfo, shape: tuple[int, ...]) -> None:
        if info.shape != tuple(shape):
            raise self._fail(
                info.name, f"shape {list(info.shape)} but expected {list(shape)} from config"
            )

    # ---- FP8 (HF) -----------------------------------------------------------------

    def _fp8_weight(self, name: str, raw: np.ndarray) -> QuantWeight:
        out_f, in_f = raw.shape
        scale_name = name + "_scale_inv"
        if not self.has(scale_name):
            raise self._fail(name, f"FP8 weight without its {describe(scale_name)}")
        grid = (_ceil_div(out_f, quant.FP8_BLOCK), _ceil_div(in_f, quant.FP8_BLOCK))
        scale = self._block_scales(scale_name, grid)
        return self._fp8_dequant(name, raw, scale)

    def _block_scales(self, scale_name: str, grid: tuple[int, int]) -> np.ndarray:
        info = self.info(scale_name)
        self._expect_shape(info, grid)
        data = self.array(scale_name)
        if info.dtype == "F32":
            return data
        if info.dtype == "BF16":
            return quant.bf16_to_f32(data)
        if info.dtype == "F8_E8M0":
            return quant.e8m0_to_f32(data)
        raise self._fail(scale_name, f"dtype {info.dtype} is not supported for FP8 scales")

    def _fp8_dequant(self, name: str, raw: np.ndarray, scale: np.ndarray) -> QuantWeight:
        out = quant.dequantize_fp8_blocks(raw, scale)
        if not np.isfinite(out).all():
            raise self._fail(name, "non-finite weight (FP8 NaN byte, or non-finite scale)")
        return QuantWeight(WeightFormat.F32, out.shape, out)

    # ---- colibri containers -------------------------------------------------------

    def container_format(self, name: str, shape: tuple[int, int]) -> ContainerFormat:
        """The format of the container weight ``name`` (U8 + ``name.qs``) of logical
        shape [O, I], from header sizes, its stamp and its file's group size hint;
        remembered by signature, as validation asks it of every tensor."""
        info, qs, key = self._signature(name, shape)
        assert qs is not None, "a container weight has .qs scales (callers check)"
        fmt = self._formats.get(key)
        if fmt is None:  # a refusal is not remembered: it names the tensor
            fmt = self._formats[key] = resolve_container_format(
                name,
                shape,
                info.nbytes,
                qs.numel,
                qs.dtype,
                stamp=self._stamps.get(name),
                hint=self.group_size_hint(name),
            )
        return fmt

    def group_size_hint(self, name: str) -> int | None:
        """The ``colibri.group_size`` hint of the file holding ``name``, if it has one."""
        f = self._file(name)
        text = f.metadata.get(GROUP_SIZE_KEY)
        if text is None:
            return None
        if not (text.isascii() and text.isdigit() and 0 < len(text) <= 6 and int(text) > 0):
            raise CheckpointError(
                f"{f.path}: __metadata__[{GROUP_SIZE_KEY!r}] = {describe(text, 24)} is not a "
                "positive integer"
            )
        return int(text)

    def _container_weight(self, name: str, shape: tuple[int, int]) -> QuantWeight:
        out_f, in_f = shape
        qs_name = name + ".qs"
        qs = self.info(qs_name)
        fmt = self.container_format(name, shape)
        raw = self._file(name).raw(name)
        if fmt.name == FP8_B128:
            grid = (_ceil_div(out_f, quant.FP8_BLOCK), _ceil_div(in_f, quant.FP8_BLOCK))
            scales = self.array(qs_name).reshape(grid)
            block = quant.e8m0_to_f32(scales) if qs.dtype == "F8_E8M0" else scales
            return self._fp8_dequant(name, raw.reshape(shape), block)
        scales = self.array(qs_name).reshape(-1)
        problem = bad_scales(scales)
        if problem:
            raise self._fail(qs_name, problem)
        if fmt.name in AFFINE_CONTAINER:  # blocks and float16 (s, m) pairs
            wf = AFFINE_CONTAINER[fmt.name]
            data = raw.reshape(out_f, affine_row_bytes(wf, in_f))
            return QuantWeight(wf, shape, data, scales.reshape(out_f, -1), fmt.group_size)
        if fmt.name == FP4_E2M1:
            data = raw.reshape(out_f, quant.q4_row_bytes(in_f))
            codes = scales.reshape(out_f, -1)
            return QuantWeight(WeightFormat.FP4, shape, data, codes, fmt.group_size)
        if fmt.name == INT8_ROW:
            return QuantWeight(WeightFormat.Q8, shape, raw.view(np.int8).reshape(shape), scales)
        data = raw.reshape(out_f, quant.q4_row_bytes(in_f))
        if fmt.name == INT4_ROW:
            return QuantWeight(WeightFormat.Q4, shape, data, scales, 0)
        groups = quant.n_groups(in_f, fmt.group_size)
        return QuantWeight(
            WeightFormat.Q4, shape, data, scales.reshape(out_f, groups), fmt.group_size
        )


def _view_of(w: QuantWeight, info: TensorInfo, qs: TensorInfo | None) -> ViewSpec | None:
    """What rebuilds ``w``'s kind from bytes, when ``w`` is its stored bytes as they are
    (not dequantised on load, as F16 and FP8 are); None otherwise."""
    if info.dtype not in ("F32", "BF16", "U8") or w.data.nbytes != info.nbytes:
        return None
    if qs is None or w.scales is None:
        return ViewSpec.of(w) if qs is None and w.scales is None else None
    return ViewSpec.of(w) if w.scales.nbytes == qs.nbytes else None


def _matrix_shape(name: str, shape: object) -> tuple[int, int]:
    """The caller's [O, I] (from config, hence untrusted): two positive ints."""
    if type(shape) is tuple and len(shape) == 2:  # the common case, checked in one go
        out_f, in_f = shape
        if type(out_f) is int and type(in_f) is int and 0 < out_f < 1 << 40 and 0 < in_f < 1 << 40:
            return shape
    if isinstance(shape, list):
        shape = tuple(shape)
    ok = (
        isinstance(shape, tuple)
        and len(shape) == 2
        and all(isinstance(d, int) and not isinstance(d, bool) and 0 < d < 1 << 40 for d in shape)
    )
    if not ok:
        raise ConfigError(f"tensor {describe(name)}: expected shape {shape!r} is not [O, I] > 0")
    return shape  # type: ignore[return-value]
