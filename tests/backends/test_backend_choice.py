"""`--backend cpu|mlx|cuda|auto` and the `backend` config key: the name becomes the
engine's ops, and a backend this machine lacks is one error line (exit 1), never a
traceback, from every command that loads a model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models

from colibrid.backends.base import KernelFamily
from colibrid.backends.cpu import CpuOps
from colibrid.backends.cuda_device import EMULATE_ENV
from colibrid.config import load_settings
from colibrid.engine import backend
from colibrid.engine.backend import make_ops, mlx_installed, resolve
from colibrid.errors import BackendError, ConfigError
from colibrid.paths import Paths


def _cuda_here() -> bool:
    try:
        make_ops("cuda")
    except BackendError:
        return False
    return True


CUDA_HERE = _cuda_here()


def test_cpu_and_auto_on_linux_are_the_native_kernels(monkeypatch) -> None:
    monkeypatch.setattr(backend, "apple_silicon", lambda: False)
    assert resolve("auto") == "cpu"
    assert isinstance(make_ops("cpu"), CpuOps) and isinstance(make_ops("auto"), CpuOps)


def test_auto_is_mlx_on_apple_silicon_when_installed(monkeypatch) -> None:
    monkeypatch.setattr(backend, "apple_silicon", lambda: True)
    monkeypatch.setattr(backend, "mlx_installed", lambda: True)
    assert resolve("auto") == "mlx"
    assert resolve("auto", KernelFamily.I8) == "cpu"  # MLX computes f32 only
    monkeypatch.setattr(backend, "mlx_installed", lambda: False)
    assert resolve("auto") == "cpu"


def test_unknown_name_and_missing_mlx_are_backend_errors(monkeypatch) -> None:
    with pytest.raises(BackendError, match="unknown backend"):
        make_ops("tpu")
    monkeypatch.setattr(backend, "mlx_installed", lambda: False)
    with pytest.raises(BackendError, match=r"pip install 'colibri\[mlx\]'"):
        make_ops("mlx")


@pytest.mark.skipif(not mlx_installed(), reason="mlx is not installed")
def test_mlx_by_name() -> None:
    assert make_ops("mlx").name == "mlx"


CONFIG_KEYS = [
    # key, default, a value in config.toml, a flag's value, a bad value, the refusal
    ("backend", "auto", "cpu", "mlx", "tpu", "backend must be one of auto, cpu, mlx, cuda"),
    ("kernel_family", "f32", "i8", "f32", "int4", "kernel_family must be one of f32, i8"),
    ("vram_gb", None, 6.5, 2.0, 0, "vram_gb must be positive"),
]


@pytest.mark.parametrize("key,default,stored,flag,bad,refusal", CONFIG_KEYS)
def test_config_key(tmp_path: Path, key, default, stored, flag, bad, refusal) -> None:  # noqa: ANN001
    """The key's default, its value from config.toml, the flag winning over it, and a bad
    value refused naming the key."""
    paths = Paths(tmp_path, tmp_path / "s.sock")
    paths.config.parent.mkdir(parents=True, exist_ok=True)
    assert getattr(load_settings(paths), key) == default
    paths.config.write_text(f"{key} = {stored!r}\n".replace("'", '"'))
    assert getattr(load_settings(paths), key) == stored
    assert getattr(load_settings(paths, **{key: flag}), key) == flag
    paths.config.write_text(f"{key} = {bad!r}\n".replace("'", '"'))
    with pytest.raises(ConfigError, match=refusal):
        load_settings(paths)


def test_vram_gb_bounds_the_device_tier(monkeypatch) -> None:
    monkeypatch.setenv(EMULATE_ENV, "1")
    assert make_ops("cuda", vram_gb=0.5).device_tier().budget == 1 << 29
    assert make_ops("cuda").device_tier().budget > 0  # 80% of what is free
    if mlx_installed():
        assert make_ops("mlx", vram_gb=1.5).device_tier().budget == 3 << 29
        assert make_ops("mlx").device_tier().budget is None


def _colibrid(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibrid", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _one_line(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("colibrid: error:") and "Traceback" not in result.stderr
    for word in words:
        assert word in result.stderr


@pytest.mark.skipif(CUDA_HERE, reason="pycuda and an NVIDIA GPU are present")
def test_cuda_without_a_gpu_is_one_line(oracle_checkpoint, tmp_path: Path) -> None:
    model = str(oracle_checkpoint("glm4_moe").out_dir)
    ids = ["--ids", "1,2", "--ids-out", "--max-tokens", "1"]
    _one_line(_colibrid("generate", "--model", model, *ids, "--backend", "cuda"), "cuda", "GPU")
    env = {**os.environ, "COLIBRI_HOME": str(tmp_path)}
    _one_line(_colibrid("run", "--model", model, "--backend", "cuda", env=env), "cuda")


def test_mlx_not_installed_is_one_line_naming_the_extra(oracle_checkpoint, tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "mlx"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no mlx here')\n")
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    model = str(oracle_checkpoint("glm4_moe").out_dir)
    ids = ["--ids", "1,2", "--ids-out", "--max-tokens", "1"]
    result = _colibrid("generate", "--model", model, *ids, "--backend", "mlx", env=env)
    _one_line(result, "pip install 'colibri[mlx]'")


@pytest.mark.skipif(not mlx_installed(), reason="mlx is not installed")
def test_generate_on_mlx_matches_transformers(oracle_checkpoint) -> None:
    ref = oracle_checkpoint(tiny_models.ARCHS[0])
    ids = ",".join(map(str, ref.prompt_ids))
    result = _colibrid(
        "generate",
        "--model",
        str(ref.out_dir),
        "--ids",
        ids,
        "--ids-out",
        "--max-tokens",
        "20",
        "--backend",
        "mlx",
    )
    assert result.returncode == 0, result.stderr
    assert [int(t) for t in result.stdout.strip().split(",")][:20] == ref.greedy_ids


@pytest.mark.skipif(not mlx_installed(), reason="mlx is not installed")
def test_bench_kernels_on_mlx() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "colibri_cli", "bench", "kernels", "--backend", "mlx"]
        + ["--seconds", "0.01", "--working-set", "4", "--format", "q4g64", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["isa"], r["family"], r["fmt"]) for r in rows] == [("mlx", "f32", "q4g64")] * 2
    assert all(r["gbs"] > 0 for r in rows)


def test_bench_kernels_on_cuda_stands_by_the_devices_own_probe() -> None:
    """On the CPU emulation of the kernels where there is no GPU (the figures then say
    nothing of a GPU; the command's path and its output are what is checked)."""
    env = {**os.environ, EMULATE_ENV: "1"}
    args = ["--seconds", "0.01", "--working-set", "1", "--format", "q4g64"]
    for json_out in (False, True):
        result = subprocess.run(
            [sys.executable, "-m", "colibri_cli", "bench", "kernels", "--backend", "cuda"]
            + args
            + (["--json"] if json_out else []),
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert result.returncode == 0, result.stderr
        if json_out:
            rows = json.loads(result.stdout)
        else:
            assert "read probe" in result.stdout and "host to device" in result.stdout
    assert [(r["isa"], r["family"], r["fmt"]) for r in rows] == [
        ("cuda", family, "q4g64") for _shape in (1, 2) for family in ("f32", "i8")
    ]
    assert all(r["gbs"] > 0 and r["membw_gbs"] > 0 for r in rows)


def _webgpu_here() -> str | None:
    try:
        make_ops("webgpu")
    except BackendError as exc:
        return str(exc)
    return None


NO_WEBGPU = _webgpu_here()


def _generate_ids(ref: tiny_models.OracleReference, *flags: str) -> list[int]:
    result = _colibrid(
        "generate",
        "--model",
        str(ref.out_dir),
        "--ids",
        ",".join(map(str, ref.prompt_ids)),
        "--ids-out",
        "--max-tokens",
        "20",
        *flags,
    )
    assert result.returncode == 0, result.stderr
    return [int(t) for t in result.stdout.strip().split(",")][:20]


def _int_experts(name: str, w):  # noqa: ANN001, ANN202
    """Routed experts as integer container tensors (int4-g64 gates and ups, int8 downs):
    what a device computes in the i8 family."""
    from colibrid.formats.quant import container_tensors, quantize
    from colibrid.formats.weights import WeightFormat

    fmt = WeightFormat.Q8 if "down" in name else WeightFormat.Q4
    return container_tensors(name, quantize(w, fmt, 64))


@pytest.mark.slow
@pytest.mark.skipif(NO_WEBGPU is not None, reason=str(NO_WEBGPU))
@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_generate_on_webgpu(oracle_checkpoint, arch: str) -> None:
    """`colibrid generate --backend webgpu`: f32 token-exact against transformers, and i8
    (integer experts) bit-identical to `--backend cpu`, on every family's checkpoint."""
    ref = oracle_checkpoint(arch)
    assert _generate_ids(ref, "--backend", "webgpu") == ref.greedy_ids
    ints = oracle_checkpoint(arch, expert_container=_int_experts)
    i8 = ("--kernel-family", "i8")
    assert _generate_ids(ints, *i8, "--backend", "webgpu") == _generate_ids(ints, *i8)


def test_webgpu_without_an_adapter_is_one_line_naming_the_package(oracle_checkpoint) -> None:
    """No Vulkan driver at all (the loader pointed at none): one line, naming what to
    install, from `colibrid generate` and from `colibri bench kernels`."""
    env = {**os.environ, "VK_ICD_FILENAMES": "/nonexistent.json", "VK_DRIVER_FILES": ""}
    model = str(oracle_checkpoint("glm4_moe").out_dir)
    ids = ["--ids", "1,2", "--ids-out", "--max-tokens", "1"]
    result = _colibrid("generate", "--model", model, *ids, "--backend", "webgpu", env=env)
    _one_line(result, "no WebGPU adapter", "mesa-vulkan-drivers")


@pytest.mark.skipif(NO_WEBGPU is not None, reason=str(NO_WEBGPU))
def test_bench_kernels_on_webgpu_stands_by_the_devices_own_probe() -> None:
    args = ["--seconds", "0.01", "--working-set", "1", "--format", "q4g64"]
    for json_out in (False, True):
        result = subprocess.run(
            [sys.executable, "-m", "colibri_cli", "bench", "kernels", "--backend", "webgpu"]
            + args
            + (["--json"] if json_out else []),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        if json_out:
            rows = json.loads(result.stdout)
        else:
            assert "read probe" in result.stdout and "host to device" in result.stdout
    assert [(r["isa"], r["family"], r["fmt"]) for r in rows] == [
        ("webgpu", family, "q4g64") for _shape in (1, 2) for family in ("f32", "i8")
    ]
    assert all(r["gbs"] > 0 and r["membw_gbs"] > 0 for r in rows)
