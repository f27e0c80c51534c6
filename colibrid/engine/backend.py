"""Which backend computes: `--backend cpu|mlx|cuda|webgpu|auto` and the `backend` key.

One place turns the name into an `Ops` object, so every command (generate, the daemon,
the benches) refuses a backend the machine lacks with the same one-line error and
never a traceback; the backend modules are imported only when chosen, so a missing
optional package costs nothing to the others.
"""

from __future__ import annotations

import importlib
import platform
import sys
from typing import TYPE_CHECKING

from colibrid.backends.base import KernelFamily
from colibrid.errors import BackendError

if TYPE_CHECKING:  # backends may not import models; the engine joins the two
    from colibrid.models.base import Ops

BACKENDS = ("auto", "cpu", "mlx", "cuda", "webgpu")
BACKEND_HELP = (
    "what computes: cpu (native SIMD kernels), mlx (MLX: Apple silicon, or mlx[cpu] on "
    "Linux), cuda (NVIDIA GPU via pycuda), webgpu (any GPU through Vulkan, Metal or DX12 "
    "via wgpu; Mesa's lavapipe on the CPU), auto (mlx on Apple silicon when installed, "
    "else cpu)"
)


def apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def mlx_installed() -> bool:
    """MLX imports here (an import that fails for any reason counts as not installed)."""
    try:
        importlib.import_module("mlx.core")
    except Exception:  # noqa: BLE001 - a broken install is as absent as a missing one
        return False
    return True


def resolve(name: str, family: KernelFamily = KernelFamily.F32) -> str:
    """The concrete backend `name` means on this machine for `family` (auto picks one:
    MLX computes only f32, so auto keeps i8 on the CPU kernels)."""
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name != "auto":
        return name
    mlx = family is KernelFamily.F32 and apple_silicon() and mlx_installed()
    return "mlx" if mlx else "cpu"


def make_ops(
    name: str = "auto", family: KernelFamily = KernelFamily.F32, vram_gb: float | None = None
) -> Ops:
    """The ops object of backend `name` (for kernel family `family`, which only steers
    auto; `vram_gb` bounds the device tier of cuda, webgpu and mlx); BackendError (one line) when
    it cannot run here."""
    budget = None if vram_gb is None else int(vram_gb * (1 << 30))  # GiB, as --ram-gb
    chosen = resolve(name, family)
    if chosen == "mlx":
        if not mlx_installed():
            raise BackendError(
                "the mlx backend needs MLX: pip install 'colibri[mlx]' "
                "(mlx on Apple silicon, mlx[cpu] on Linux)"
            )
        from colibrid.backends.mlx import MlxOps

        return MlxOps(budget)
    if chosen == "cuda":
        from colibrid.backends.cuda import CudaOps

        return CudaOps(vram_bytes=budget)
    if chosen == "webgpu":
        from colibrid.backends.webgpu import WebgpuOps

        return WebgpuOps(vram_bytes=budget)
    from colibrid.backends.cpu import CpuOps

    return CpuOps()
