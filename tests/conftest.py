"""Repository-wide pytest configuration: the shared oracle-checkpoint, chat-model and demo
fixtures, and the opt-in `matrix` marker (the full daemon invariance matrix,
tests/invariance/test_daemon_matrix.py: run with ``COLIBRI_MATRIX=1`` or ``-m matrix``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Make the oracle helpers (tests/oracle/tiny_models.py) importable from any test:
# `import tiny_models`.
_ORACLE = str(Path(__file__).resolve().parent / "oracle")
if _ORACLE not in sys.path:
    sys.path.insert(0, _ORACLE)

import tiny_models  # noqa: E402
from daemon_helpers import install_chat_tokenizer  # noqa: E402


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


@pytest.fixture(scope="session")
def chat_model(oracle_checkpoint, tmp_path_factory) -> Path:
    """The tiny GLM-4 checkpoint plus a byte-level BPE tokenizer and a GLM-style template
    (shared by the generate CLI and the daemon tests)."""
    ref = oracle_checkpoint("glm4_moe")
    model = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(ref.out_dir, model)
    install_chat_tokenizer(model)
    return model


# ---- the built-in demo model (tests/demo, tests/invariance/test_daemon_matrix.py) ---------
@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    from colibrid.convert.demo import fetch_gguf
    from colibrid.errors import ConvertError

    try:
        return fetch_gguf(lambda msg: None)
    except ConvertError as exc:
        pytest.skip(f"demo GGUF unavailable: {exc}")


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory, demo_gguf: Path) -> Path:
    """A COLIBRI_HOME with the demo pulled (`pull --from`, offline path)."""
    home = tmp_path_factory.mktemp("colibri-home")
    env = {**os.environ, "COLIBRI_HOME": str(home)}
    r = subprocess.run(
        [sys.executable, "-m", "colibri_cli", "pull", "demo", "--from", str(demo_gguf), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "demo: installed at" in r.stdout
    return home


@pytest.fixture(scope="session")
def demo_container(demo_home: Path) -> Path:
    return demo_home / "models" / "demo"


# ---- the opt-in `matrix` marker ------------------------------------------------------------
def matrix_enabled(config: pytest.Config) -> bool:
    """`matrix` tests run with COLIBRI_MATRIX=1 or when `-m` names the marker."""
    return os.environ.get("COLIBRI_MATRIX") == "1" or "matrix" in (config.option.markexpr or "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if matrix_enabled(config):
        return
    skip = pytest.mark.skip(
        reason="full daemon invariance matrix (slow): run with COLIBRI_MATRIX=1 or -m matrix"
    )
    for item in items:
        if item.get_closest_marker("matrix") is not None:
            item.add_marker(skip)
