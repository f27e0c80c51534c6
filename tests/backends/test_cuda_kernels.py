"""The cuda backend below its ops: the kernel source compiles for the GPU where nvcc is
installed (even without a GPU), every kernel is declared for the host, and a crowded GPU
empties the tier before it says so. What every device backend must do (the tier, the
products, the I8 family's bits) is tests/backends/test_device_backends.py, which runs the
cuda backend on its CPU emulation and on a GPU where there is one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from colibrid.backends.base import KernelFamily
from colibrid.backends.cuda import CudaOps
from colibrid.backends.cuda_device import EmulatedDevice, kernel_dir, kernel_source, signatures
from colibrid.errors import BackendError
from colibrid.formats.quant import quantize
from colibrid.formats.weights import QuantWeight, WeightFormat

F32 = KernelFamily.F32


def _weight(o: int, i: int, seed: int) -> QuantWeight:
    w = np.random.default_rng(seed).standard_normal((o, i), dtype=np.float32)
    return quantize(w, WeightFormat.Q4, 64)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_compile_for_the_gpu(tmp_path: Path, arch: str) -> None:
    out = tmp_path / "kernels.ptx"
    done = subprocess.run(
        ["nvcc", "--ptx", f"-arch={arch}", str(kernel_dir() / "kernels.cu"), "-o", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    ptx = out.read_text()
    for name in signatures(kernel_source()):
        assert f".entry {name}(" in ptx


def test_every_kernel_is_declared_for_the_host() -> None:
    sigs = signatures(kernel_source())
    assert {"mm_partial", "mm_reduce", "swiglu", "gather_rows", "scale_rows"} <= set(sigs)
    assert [p.kind for p in sigs["mm_reduce"]] == ["ptr", "ptr", "int", "int", "ptr"]


class _CrowdedDevice(EmulatedDevice):
    """The emulated device, refusing the next ``refuse`` allocations as a GPU does when
    another program has taken its memory."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = 0

    def alloc(self, nbytes: int):  # noqa: ANN201
        if self.refuse > 0:
            self.refuse -= 1
            raise MemoryError("cuMemAlloc failed: out of memory")
        return super().alloc(nbytes)


def test_a_crowded_device_empties_the_tier_then_says_so_in_one_line() -> None:
    device = _CrowdedDevice()
    ops = CudaOps(device, vram_bytes=1 << 30)
    weights = [_weight(32, 128, seed) for seed in range(4)]
    x = np.random.default_rng(2).standard_normal((2, 128), dtype=np.float32)
    want = [ops.matmul(w, x, F32) for w in weights[:3]]
    assert ops.tier.stats.weights == 3
    device.refuse = 1  # the next copy fails once: the tier lets go of all it holds, retries
    extra = ops.matmul(weights[3], x, F32)
    assert ops.tier.stats.weights == 1
    np.testing.assert_array_equal(extra, CudaOps(EmulatedDevice()).matmul(weights[3], x, F32))
    device.refuse = 2  # no room even when empty: one clear error, and nothing lost
    with pytest.raises(BackendError, match="no room for a .* MiB weight"):
        ops.matmul(weights[0], x, F32)
    for w, expected in zip(weights[:3], want, strict=True):
        np.testing.assert_array_equal(ops.matmul(w, x, F32), expected)
