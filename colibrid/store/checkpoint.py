"""A model directory: config.json plus safetensors weight files, read as typed weights.

Why this layer exists: model code asks for ``weight(name, (O, I))`` and gets a
:class:`QuantWeight` in whatever format the files hold (an HF checkpoint in F32, BF16,
F16 or block-scaled FP8, or an upstream colibri container with int8/int4 weights),
with the logical shape it derived from config.json *checked* against the bytes. Every
problem with untrusted files surfaces as one CheckpointError / ConfigError line naming
the file or tensor.

This module opens the directory and indexes its tensors: a tensor defined in two files,
or not where the index claims, is an error. Files are memory-mapped lazily; nothing
reads a whole file. Finding the files is :mod:`colibrid.store.checkpoint_files`, the
dtype conversion :mod:`colibrid.store.typed_weights`, and the format inference of
colibri containers :mod:`colibrid.store.container_format`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import numpy as np

from colibrid.errors import CheckpointError, ConfigError
from colibrid.formats.weights import WeightLayout
from colibrid.store.checkpoint_files import (
    CONFIG_NAME,
    INDEX_NAME,
    _glob_files,
    _index_files,
    _refuse_incomplete_conversion,
    read_small_file,
)
from colibrid.store.container_format import ContainerFormat, _collect_stamps
from colibrid.store.safetensors_file import SafetensorsFile
from colibrid.store.safetensors_header import TensorInfo
from colibrid.store.strict_json import describe, load_json_object
from colibrid.store.typed_weights import TypedWeights
from colibrid.store.view_spec import ViewSpec


class Checkpoint(TypedWeights):
    """A model directory opened for reading: config, tensor index, typed weights."""

    def __init__(self, model_dir: Path, config: dict[str, object], files: list[SafetensorsFile]):
        self.dir = model_dir
        self._config = config
        self.files = files
        self._where: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.tensors:
                other = self._where.setdefault(name, f)
                if other is not f:
                    raise CheckpointError(
                        f"{model_dir}: tensor {describe(name)} is defined in both "
                        f"{other.path.name} and {f.path.name}"
                    )
        self._stamps = _collect_stamps(files)
        self.matrix_layouts: dict[WeightLayout, int] = {}
        self.matrix_kinds: dict[str, tuple[WeightLayout, int]] = {}  # TypedWeights.weight's
        self._views: dict[tuple, ViewSpec | None] = {}  # TypedWeights.weight's memo
        self._formats: dict[tuple, ContainerFormat] = {}  # TypedWeights.container_format's

    @classmethod
    def open(cls, model_dir: str | os.PathLike[str]) -> Checkpoint:
        root = Path(model_dir)
        if not root.exists():
            raise CheckpointError(f"{root}: model directory not found")
        if not root.is_dir():
            raise CheckpointError(f"{root}: not a directory")
        _refuse_incomplete_conversion(root)
        config = load_json_object(
            read_small_file(root / CONFIG_NAME, CONFIG_NAME, ConfigError),
            str(root / CONFIG_NAME),
            ConfigError,
        )
        index = root / INDEX_NAME
        claims: dict[str, Path] = {}
        if index.exists():
            paths, claims = _index_files(root, index)
        else:
            paths = _glob_files(root)
        if not paths:
            raise CheckpointError(f"{root}: no *.safetensors weight files")
        files: list[SafetensorsFile] = []
        try:
            for path in paths:
                files.append(SafetensorsFile.open(path))
            ckpt = cls(root, config, files)
            ckpt._check_claims(index, claims)
        except BaseException:
            for f in files:
                f.close()
            raise
        return ckpt

    def _check_claims(self, index: Path, claims: dict[str, Path]) -> None:
        for tensor, path in claims.items():
            f = self._where.get(tensor)
            if f is None or f.path != path:
                raise CheckpointError(
                    f"{index}: tensor {describe(tensor)} is not in {path.name} as claimed"
                )

    # ---- lookup -------------------------------------------------------------------

    @property
    def config(self) -> dict[str, object]:
        """config.json as parsed (validated to be a JSON object; values unchecked)."""
        return self._config

    def names(self) -> list[str]:
        return sorted(self._where)

    def infos(self) -> Iterator[TensorInfo]:
        """Every tensor's record, file by file, in no particular order."""
        for f in self.files:
            yield from f.tensors.values()

    def has(self, name: str) -> bool:
        return name in self._where

    def _file(self, name: str) -> SafetensorsFile:
        try:
            return self._where[name]
        except KeyError:
            raise CheckpointError(f"{self.dir}: tensor {describe(name)} not found") from None

    def stamp(self, name: str) -> str | None:
        """The ``colibri.fmt`` stamp of tensor ``name``, if its container has one (what a
        rewrite must carry over: colibrid/convert/requant.py)."""
        return self._stamps.get(name)

    def info(self, name: str) -> TensorInfo:
        return self._file(name).tensors[name]

    def file_of(self, name: str) -> Path:
        return self._file(name).path

    def array(self, name: str) -> np.ndarray:
        """The raw read-only view of a tensor (see SafetensorsFile.array)."""
        return self._file(name).array(name)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes, a flat read-only uint8 view of the map (digests)."""
        return self._file(name).raw(name)

    def _fail(self, name: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.file_of(name)}: tensor {describe(name)}: {problem}")

    # ---- lifetime -----------------------------------------------------------------

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.dir)!r}, {len(self.files)} files, {len(self._where)} tensors)"
