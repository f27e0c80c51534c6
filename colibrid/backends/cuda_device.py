"""Where the cuda backend's kernels run: an NVIDIA GPU through pycuda, or this CPU.

Both devices take the same kernel source (native/cuda/kernels.cu) and the same calls:
allocate, copy in, launch a kernel over n threads, copy out. Addresses are plain ints, so
the backend offsets into a buffer (a weight's rows, an expert's slice of a batch) without
asking which device it has.

The CPU device compiles the source as C++ with native/cuda/emulate.h and runs every
thread of a launch one after another. That is exact for colibri's kernels, whose threads
never share memory or wait for each other, and lets the test suite hold the CUDA
arithmetic and every line of the backend above it to the numpy reference and to
transformers on machines without a GPU (COLIBRI_CUDA_EMULATE=1). It is for tests and
development: slow, and it says nothing about a GPU's speed.

A kernel's parameters are read from its signature in the source (pointers, int, float),
so adding a kernel needs no second declaration here.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from colibrid.backends.native_build import cache_base, locked, source_root
from colibrid.errors import BackendError, first_line

BLOCK = 256
"""Threads per block of every launch."""

EMULATE_ENV = "COLIBRI_CUDA_EMULATE"
"""Set to 1: `--backend cuda` runs its kernels on the CPU (tests, development)."""

_SIGNATURE = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)')


def kernel_dir() -> Path:
    return source_root() / "cuda"


def kernel_source() -> str:
    return (kernel_dir() / "kernels.cu").read_text()


@dataclass(frozen=True)
class Param:
    kind: str  # 'ptr', 'int' or 'float'
    declaration: str  # as the source spells it, e.g. 'const float *x'
    name: str


def signatures(source: str) -> dict[str, list[Param]]:
    """Each kernel's parameters, in order, read from its signature in the source."""
    found: dict[str, list[Param]] = {}
    for kernel, params in _SIGNATURE.findall(source):
        found[kernel] = []
        for param in params.split(","):
            declared = " ".join(param.split())
            name = re.findall(r"\w+", declared)[-1]
            if "*" in declared:
                kind = "ptr"
            elif declared.removeprefix("const ").startswith("int "):
                kind = "int"
            elif declared.removeprefix("const ").startswith("float "):
                kind = "float"
            else:
                raise ValueError(f"kernel {kernel}: {declared!r} is not a pointer, int or float")
            found[kernel].append(Param(kind, declared, name))
    return found


class Buffer(Protocol):
    """Device memory, freed when the object goes."""

    ptr: int
    nbytes: int


class Device(Protocol):
    """What the cuda backend asks of a device."""

    name: str

    def alloc(self, nbytes: int) -> Buffer: ...

    def upload(self, ptr: int, host: np.ndarray) -> None:
        """Copy a C-contiguous host array to device address ``ptr``."""
        ...

    def download(self, host: np.ndarray, ptr: int) -> None:
        """Fill the C-contiguous host array from device address ``ptr``."""
        ...

    def launch(self, kernel: str, threads: int, *args: int | float) -> None:
        """Run ``kernel`` over ``threads`` threads; pointer arguments are int addresses."""
        ...

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        ...


def blocks(threads: int) -> int:
    return max(1, -(-threads // BLOCK))


# ---- the CPU -------------------------------------------------------------------------------
@dataclass(eq=False)
class HostBuffer:
    array: np.ndarray
    ptr: int
    nbytes: int


_CDEF_TYPE = {"ptr": "void *", "int": "int", "float": "float"}


def _launchers(sigs: dict[str, list[Param]]) -> tuple[str, str]:
    """C++ launchers, one per kernel (the grid loop around it, taking the kernel's own
    parameters), and their cffi declarations (any pointer passes as void *)."""
    code, cdef = [], []
    for kernel, params in sigs.items():
        typed = ", ".join(p.declaration for p in params)
        untyped = ", ".join(f"{_CDEF_TYPE[p.kind]} {p.name}" for p in params)
        call = ", ".join(p.name for p in params)
        cdef.append(f"void launch_{kernel}(long long launch_threads, {untyped});")
        code.append(
            f'extern "C" void launch_{kernel}(long long launch_threads, {typed}) {{\n'
            f"    blockDim.x = {BLOCK};\n"
            f"    gridDim.x = (unsigned)((launch_threads + {BLOCK - 1}) / {BLOCK});\n"
            "    for (unsigned b = 0; b < gridDim.x; b++) {\n"
            "        blockIdx.x = b;\n"
            f"        for (unsigned t = 0; t < {BLOCK}; t++) {{\n"
            "            threadIdx.x = t;\n"
            f"            {kernel}({call});\n"
            "        }\n    }\n}\n"
        )
    return "\n".join(code), "\n".join(cdef)


class EmulatedDevice:
    """The kernels compiled for this CPU, one thread after another (see the module doc)."""

    name = "cpu-emulated"

    def __init__(self) -> None:
        import cffi

        source = kernel_source()
        self._sigs = signatures(source)
        code, cdef = _launchers(self._sigs)
        self._ffi = cffi.FFI()
        self._ffi.cdef(cdef)
        self._lib = self._ffi.dlopen(str(_build_emulation(source, code)))
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> HostBuffer:
        array = np.empty(max(1, -(-nbytes // 16)), dtype=np.complex128)  # 16-byte aligned
        return HostBuffer(array, array.ctypes.data, nbytes)

    def upload(self, ptr: int, host: np.ndarray) -> None:
        src = np.ascontiguousarray(host)
        self._ffi.memmove(self._ffi.cast("char *", ptr), self._ffi.from_buffer(src), src.nbytes)

    def download(self, host: np.ndarray, ptr: int) -> None:
        if not host.flags.c_contiguous:
            raise ValueError("download needs a C-contiguous array")
        self._ffi.memmove(self._ffi.from_buffer(host), self._ffi.cast("char *", ptr), host.nbytes)

    def launch(self, kernel: str, threads: int, *args: int | float) -> None:
        params = self._sigs[kernel]
        if len(args) != len(params):
            raise TypeError(f"{kernel} takes {len(params)} arguments, not {len(args)}")
        packed = [
            self._ffi.cast("void *", a) if p.kind == "ptr" else a
            for a, p in zip(args, params, strict=True)
        ]
        with self._lock:  # the launch indices are globals of the emulation
            getattr(self._lib, f"launch_{kernel}")(threads, *packed)

    def memory(self) -> tuple[int, int]:
        page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
        free = os.sysconf("SC_AVPHYS_PAGES") * page
        return free, pages * page


def _build_emulation(source: str, launchers: str) -> Path:
    """The emulation library, built once per source into the native build cache."""
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        raise BackendError(
            f"emulating the cuda kernels needs a C++ compiler ({compiler!r} not found)"
        )
    flags = ["-O2", "-fPIC", "-shared", "-std=c++14", "-fno-strict-aliasing", "-ffp-contract=off"]
    flags.append("-DCOLIBRI_CUDA_EMULATE")
    header = (kernel_dir() / "emulate.h").read_text()
    digest = hashlib.sha256("\0".join([source, header, launchers, compiler, *flags]).encode())
    base = cache_base()
    final = base / f"cuda-emulated-{digest.hexdigest()[:20]}.so"
    if final.is_file():
        return final
    with locked(base / (final.name + ".lock")):
        if final.is_file():
            return final
        with tempfile.TemporaryDirectory(dir=base) as tmp:
            unit = Path(tmp) / "emulated.cpp"
            unit.write_text(f'#include "kernels.cu"\n{launchers}')
            out = Path(tmp) / final.name
            cmd = [compiler, *flags, f"-I{kernel_dir()}", str(unit), "-o", str(out)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise BackendError(
                    f"building the emulated cuda kernels failed: {first_line(done.stderr)}"
                )
            os.replace(out, final)
    return final


# ---- an NVIDIA GPU ---------------------------------------------------------------------------
class PycudaDevice:
    """Device 0 through pycuda: its primary context made current around every call (the
    daemon computes on worker threads), the kernels compiled once by pycuda at start."""

    name = "cuda"

    def __init__(self) -> None:
        import pycuda.driver as cuda
        from pycuda.compiler import SourceModule

        self._cuda = cuda
        cuda.init()
        if cuda.Device.count() < 1:
            raise BackendError("the cuda backend found no NVIDIA GPU")
        self._context = cuda.Device(0).retain_primary_context()
        source = kernel_source()
        self._sigs = signatures(source)
        with self._current():
            module = SourceModule(
                source, no_extern_c=True, options=["-O3"], include_dirs=[str(kernel_dir())]
            )
            self._functions = {name: module.get_function(name) for name in self._sigs}
        self.name = f"cuda ({cuda.Device(0).name()})"

    @contextmanager
    def _current(self) -> Iterator[None]:
        self._context.push()
        try:
            yield
        finally:
            self._cuda.Context.pop()

    def alloc(self, nbytes: int) -> Any:
        with self._current():
            allocation = self._cuda.mem_alloc(max(1, nbytes))
        return _GpuBuffer(allocation, int(allocation), nbytes)

    def upload(self, ptr: int, host: np.ndarray) -> None:
        with self._current():
            self._cuda.memcpy_htod(ptr, np.ascontiguousarray(host))

    def download(self, host: np.ndarray, ptr: int) -> None:
        with self._current():
            self._cuda.memcpy_dtoh(host, ptr)

    def launch(self, kernel: str, threads: int, *args: int | float) -> None:
        convert = {"ptr": np.uintp, "int": np.int32, "float": np.float32}
        packed = [convert[p.kind](a) for a, p in zip(args, self._sigs[kernel], strict=True)]
        with self._current():
            self._functions[kernel](*packed, block=(BLOCK, 1, 1), grid=(blocks(threads), 1))

    def memory(self) -> tuple[int, int]:
        with self._current():
            free, total = self._cuda.mem_get_info()
        return int(free), int(total)


@dataclass(eq=False)
class _GpuBuffer:
    allocation: Any  # pycuda's DeviceAllocation: freed with this object
    ptr: int
    nbytes: int


def read_probe(device: Device, nbytes: int, repeats: int = 5) -> float:
    """GB/s at which the device reads its own memory (kernels.cu read_sum over ``nbytes``,
    best of ``repeats``): the roofline the cuda rows of `colibri bench kernels` stand by."""
    words = max(1, nbytes // 16)
    threads = min(words, 1 << 20)
    data, sums = device.alloc(words * 16), device.alloc(threads * 4)
    done = np.empty(1, dtype=np.float32)
    best = float("inf")
    for n in range(repeats + 1):  # the first pass warms up
        t0 = time.perf_counter()
        device.launch("read_sum", threads, data.ptr, words, threads, sums.ptr)
        device.download(done, sums.ptr)  # waits for the launch
        if n:
            best = min(best, time.perf_counter() - t0)
    return words * 16 / best / 1e9


def copy_probe(device: Device, nbytes: int, repeats: int = 3) -> float:
    """GB/s of a host-to-device copy from ordinary (pageable) memory, as the tier's copies
    are made: what a weight not yet on the device costs to bring over."""
    host = np.ones(max(1, nbytes // 4), dtype=np.float32)
    target = device.alloc(host.nbytes)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        device.upload(target.ptr, host)
        best = min(best, time.perf_counter() - t0)
    return host.nbytes / best / 1e9


def open_device() -> Device:
    """The device `--backend cuda` computes on: the CPU emulation when COLIBRI_CUDA_EMULATE
    is 1, else GPU 0 through pycuda; BackendError (one line) when there is none. Opened
    once per process: the daemon's start-up check and its model share one device, its
    context and its compiled kernels."""
    return _open_device(os.environ.get(EMULATE_ENV) == "1")


def open_gpu() -> Device:
    """GPU 0 through pycuda whatever COLIBRI_CUDA_EMULATE says (the tests that run the
    kernels on both); BackendError when there is none."""
    return _open_device(False)


@functools.cache  # a failure raises, so it is not kept: the next call tries again
def _open_device(emulate: bool) -> Device:
    if emulate:
        return EmulatedDevice()
    try:
        import pycuda.driver  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is as absent as a missing one
        raise BackendError(
            "the cuda backend needs pycuda and an NVIDIA GPU: pip install 'colibri[cuda]'"
        ) from None
    try:
        return PycudaDevice()
    except BackendError:
        raise
    except Exception as exc:  # noqa: BLE001 - no driver, no device, no nvcc: one line
        raise BackendError(
            f"the cuda backend found no usable NVIDIA GPU ({first_line(exc)})"
        ) from None
