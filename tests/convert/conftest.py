"""Fixtures for converter tests: source checkpoints in each input encoding, each with the
transformers reference computed on exactly the weights the converted container holds.

The source's routed experts are stored in the tested encoding (bf16, FP8 blocks, NVFP4)
via ``expert_container``; ``expert_transform`` gives the reference the weights the engine
will see after conversion: decode(source encoding) then int4-g64 quantise/dequantise,
computed with the independent numpy maths of quant_reference.py (not the converter's code).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_models
from quant_reference import ARCH, EXACT_FLAGS, encoding, int4_roundtrip


@pytest.fixture(scope="session")
def source_checkpoint(oracle_checkpoint):
    """``source_checkpoint(dtype) -> OracleReference`` whose folder is a conversion source
    (experts in ``dtype``; other tensors f32, or bf16/fp8 for those dtypes) and whose
    reference used int4-g64(decode(source)) experts."""
    cache: dict[str, tiny_models.OracleReference] = {}

    def get(dtype: str) -> tiny_models.OracleReference:
        if dtype not in cache:
            container, decode = encoding(dtype)
            base = "f32" if dtype == "nvfp4" else dtype
            cache[dtype] = oracle_checkpoint(
                ARCH,
                base,
                expert_transform=lambda n, w: int4_roundtrip(decode(w)),
                expert_container=container,
            )
        return cache[dtype]

    return get


@pytest.fixture(scope="session")
def converted(source_checkpoint, tmp_path_factory):
    """``converted(dtype) -> (reference, container dir)``, default params but f32
    non-expert classes."""
    from colibri_cli.main import main

    cache: dict[str, tuple[tiny_models.OracleReference, Path]] = {}

    def get(dtype: str) -> tuple[tiny_models.OracleReference, Path]:
        if dtype not in cache:
            ref = source_checkpoint(dtype)
            dst = tmp_path_factory.mktemp(f"conv-{dtype}") / "c"
            assert main(["convert", str(ref.out_dir), str(dst), *EXACT_FLAGS]) == 0
            cache[dtype] = (ref, dst)
        return cache[dtype]

    return get
