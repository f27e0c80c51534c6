"""Repository-wide pytest configuration and the shared oracle-checkpoint fixture."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Make the oracle helpers (tests/oracle/tiny_models.py) importable from any test:
# `import tiny_models`.
_ORACLE = str(Path(__file__).resolve().parent / "oracle")
if _ORACLE not in sys.path:
    sys.path.insert(0, _ORACLE)

import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def oracle_checkpoint(tmp_path_factory):
    """Factory: ``oracle_checkpoint(arch, dtype="f32", **kw) -> tiny_models.OracleReference``.

    Plain builds (no expert_transform / expert_container / config_overrides) are cached for the
    session; custom builds get a fresh directory each call. ``ref.out_dir`` is the checkpoint
    folder; treat it as read-only.
    """
    cache: dict = {}

    def get(
        arch: str,
        dtype: str = "f32",
        *,
        seed: int | None = None,
        with_mtp: bool = True,
        expert_transform=None,
        expert_container=None,
        config_overrides=None,
    ) -> tiny_models.OracleReference:
        custom = expert_transform is not None or expert_container is not None or config_overrides
        key = (arch, dtype, seed, with_mtp)
        if not custom and key in cache:
            return cache[key]
        out = tmp_path_factory.mktemp(f"oracle-{arch}-{dtype}")
        ref = tiny_models.build_checkpoint(
            arch,
            out,
            dtype=dtype,
            seed=seed,
            with_mtp=with_mtp,
            expert_transform=expert_transform,
            expert_container=expert_container,
            config_overrides=config_overrides,
        )
        if not custom:
            cache[key] = ref
        return ref

    return get
