"""The cuda backend below its ops: the kernel source compiles for the GPU where nvcc is
installed (even without a GPU), and the VRAM tier keeps device copies within its budget,
drops a copy when its weight goes, and never changes a result by what it holds (on the
CPU emulation of the kernels, which needs no GPU)."""

from __future__ import annotations

import gc
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from colibrid.backends.base import ExpertBatch, KernelFamily
from colibrid.backends.cuda import CudaOps
from colibrid.backends.cuda_device import EmulatedDevice, kernel_dir, kernel_source, signatures
from colibrid.errors import BackendError
from colibrid.formats.quant import dequantize, quantize
from colibrid.formats.weights import QuantWeight, WeightFormat
from colibrid.models.base import apply_experts_each

F32 = KernelFamily.F32


@pytest.fixture(scope="module")
def device() -> EmulatedDevice:
    return EmulatedDevice()


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


def test_the_tier_keeps_to_its_budget_and_never_changes_a_result(device) -> None:  # noqa: ANN001
    weights = [_weight(48, 128, seed) for seed in range(6)]
    x = np.random.default_rng(9).standard_normal((3, 128), dtype=np.float32)
    roomy = CudaOps(device, vram_bytes=1 << 30)
    one_fits = CudaOps(device, vram_bytes=weights[0].nbytes + 64)
    want = [roomy.matmul(w, x, F32) for w in weights]
    for _ in range(2):  # the second pass re-copies what the small tier evicted
        got = [one_fits.matmul(w, x, F32) for w in weights]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    small, big = one_fits.tier.stats, roomy.tier.stats
    assert small.weights == 1 and small.bytes <= small.budget
    assert small.copies == 12 and small.hits == 0
    for w in weights:
        roomy.matmul(w, x, F32)
    assert big.weights == 6 and big.copies == 6 and big.hits == 6


def test_a_weights_copy_goes_with_it(device) -> None:  # noqa: ANN001
    ops = CudaOps(device, vram_bytes=1 << 30)
    w = _weight(16, 64, 1)
    ops.matmul(w, np.ones((1, 64), dtype=np.float32), F32)
    assert ops.tier.stats.weights == 1 and ops.tier.stats.bytes > 0
    del w
    gc.collect()
    assert ops.tier.stats.weights == 0 and ops.tier.stats.bytes == 0


def test_rows_are_computed_alone(device) -> None:  # noqa: ANN001
    """S rows give the bits of S single-row calls (the batch never changes a result)."""
    ops = CudaOps(device)
    w = _weight(40, 192, 3)
    x = np.random.default_rng(4).standard_normal((6, 192), dtype=np.float32)
    together = ops.matmul(w, x, F32)
    for s in range(6):
        np.testing.assert_array_equal(ops.matmul(w, x[s : s + 1], F32)[0], together[s])


def test_the_i8_family_is_refused(device) -> None:  # noqa: ANN001
    with pytest.raises(BackendError, match="f32 kernel family only"):
        CudaOps(device).matmul(_weight(8, 64, 0), np.ones((1, 64), np.float32), KernelFamily.I8)


@pytest.mark.parametrize(
    "i,group",
    [(128, 64), (100, 64), (96, 16), (130, 0)],
    ids=["whole-chunks", "ragged-row", "groups-inside-a-chunk", "per-row-odd"],
)
def test_every_path_of_the_product_kernel(device, i: int, group: int) -> None:  # noqa: ANN001
    """The 16-byte path (whole aligned chunks under one scale) and the per-weight path
    (ragged rows, a group boundary inside a chunk) against the dequantised product."""
    w = np.random.default_rng(i).standard_normal((24, i), dtype=np.float32)
    q = quantize(w, WeightFormat.Q4, group)
    x = np.random.default_rng(5).standard_normal((5, i), dtype=np.float32)
    want = x.astype(np.float64) @ dequantize(q).astype(np.float64).T
    got = CudaOps(device).matmul(q, x, F32)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


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


def test_products_launched_together_give_the_bits_of_each_alone(device) -> None:  # noqa: ANN001
    """q/k/v in one launch, every expert of a layer in one launch (the shared expert of
    another width among them): the bits of one product, or one expert, at a time."""
    ops = CudaOps(device)
    x = np.random.default_rng(6).standard_normal((3, 128), dtype=np.float32)
    weights = [_weight(o, 128, seed) for seed, o in enumerate((64, 32, 32))]
    together = ops.matmul_many(weights, x, F32)
    for w, got in zip(weights, together, strict=True):
        np.testing.assert_array_equal(got, ops.matmul(w, x, F32))

    def expert(seed: int, width: int):  # noqa: ANN202
        return SimpleNamespace(
            gate=_weight(width, 128, seed),
            up=_weight(width, 128, seed + 1),
            down=_weight(128, width, seed + 2),
        )

    experts = [expert(10, 64), expert(20, 64), expert(30, 96)]  # the last: another width
    batch = ExpertBatch(experts, [0, 2, 3, 6], [0, 2, 1, 0, 1, 2], [0.5, 0.25, 1.0, 1.0, 1.0, 1.0],
                        [0, 1, 2, 3, 4, 5])  # fmt: skip
    got, want = np.zeros((6, 128), np.float32), np.zeros((6, 128), np.float32)
    ops.apply_experts(batch, x, got, F32)
    apply_experts_each(ops, batch, x, want, F32)
    np.testing.assert_array_equal(got, want)
