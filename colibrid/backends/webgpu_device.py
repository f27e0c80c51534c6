"""Where the webgpu backend's kernels run: a WebGPU adapter through wgpu (the `wgpu`
package: Vulkan on Linux and Windows, Metal on macOS, DX12 on Windows).

That is a GPU of any vendor, or, on a machine without one, Mesa's lavapipe: a real Vulkan
driver that runs the same shaders on the CPU (Debian's `mesa-vulkan-drivers`), which is
how CI runs this backend's buffers, uploads, shaders and dispatches for real. lavapipe's
figures are CPU figures.

The kernels are WGSL (native/webgpu/*.wgsl). A `Commands` records an op's dispatches,
each with its parameters (one block of a uniform buffer, bound at a dynamic offset, so a
weight's bind group is made once and reused); `GpuDevice.run` encodes them in one compute
pass, copies the result to a mapped buffer and waits for it.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from colibrid.backends.native_build import source_root
from colibrid.errors import BackendError, first_line

PARAM_WORDS = 16
"""u32s of one dispatch's parameters (kernels.wgsl Params, elementwise.wgsl Span)."""

PARAM_BLOCKS = 8192
"""Dispatches one submission may carry: the parameter buffer is made once this large, so
the bind groups that name it stay valid for the device's life."""

MAX_GROUPS_X = 65535
"""Workgroups along one dimension of a dispatch (WebGPU's limit); more go along y."""

KERNELS = {
    "mm_f32": "kernels.wgsl",
    "mm_i8": "kernels.wgsl",
    "mm_f32_rows": "kernels.wgsl",
    "mm_i8_rows": "kernels.wgsl",
    "swiglu": "elementwise.wgsl",
    "read_sum": "elementwise.wgsl",
}
"""Each kernel's source file; its bindings are the file's (PRODUCT or ELEMENTWISE)."""

PRODUCT_BINDINGS = ("read", "read", "read", "read", "write")  # w, sc, x, xs, y; then params
ELEMENTWISE_BINDINGS = ("read", "read", "write")  # a, b, out; then params

DOT4_BUILTIN = """
fn dot4(a: u32, b: u32) -> i32 {
    return dot4I8Packed(a, b);
}
"""
DOT4_PORTABLE = """
fn dot4(a: u32, b: u32) -> i32 {
    var sum = 0;
    for (var k = 0u; k < 32u; k += 8u) {
        sum += extractBits(i32(a), k, 8u) * extractBits(i32(b), k, 8u);
    }
    return sum;
}
"""
"""kernels.wgsl's integer dot: the builtin (a dot-product instruction where the adapter
has one), or the same integers byte by byte where its shader compiler lacks it."""

INSTALL_HINT = (
    "no WebGPU adapter here: the webgpu backend needs a GPU driver with Vulkan, Metal or "
    "DX12, or, to run on the CPU, Mesa's lavapipe (Debian/Ubuntu: apt install "
    "mesa-vulkan-drivers)"
)


@dataclass(frozen=True)
class Adapter:
    """What computes: the adapter's name, the API wgpu drives it through and its kind
    (discrete or integrated GPU, CPU)."""

    name: str
    api: str
    kind: str

    def describe(self) -> str:
        kind = {"DiscreteGPU": "GPU", "IntegratedGPU": "integrated GPU"}.get(self.kind, self.kind)
        return f"{self.name} ({self.api}, {kind})"


@dataclass(frozen=True)
class Kernel:
    name: str
    pipeline: Any
    layout: Any


@dataclass
class Commands:
    """One op's dispatches, in order: (kernel, bind group, parameter block, workgroups)."""

    dispatches: list[tuple[Kernel, Any, int, tuple[int, int]]] = field(default_factory=list)
    params: list[np.ndarray] = field(default_factory=list)

    def add(self, kernel: Kernel, group: Any, params: Sequence[int], count: int) -> None:
        """Dispatch ``kernel`` over ``count`` workgroups with ``params`` (its u32s, the
        workgroup grid's x extent filled in where the kernel wants it)."""
        grid = (min(count, MAX_GROUPS_X), -(-count // MAX_GROUPS_X))
        block = np.zeros(PARAM_WORDS, dtype=np.uint32)
        block[: len(params)] = params
        self.params.append(block)
        self.dispatches.append((kernel, group, len(self.params) - 1, grid))


def _wgpu() -> Any:
    """The wgpu module, restricted to the native APIs (GL adds nothing here), or a
    BackendError naming what to install."""
    try:
        import wgpu
        from wgpu.backends.wgpu_native import extras
    except ImportError:
        raise BackendError("the webgpu backend needs wgpu: pip install 'colibri[webgpu]'") from None
    if not os.environ.get("XDG_RUNTIME_DIR"):  # Mesa's window-system probe asks for one
        runtime = Path(tempfile.gettempdir()) / f"colibri-xdg-{os.getuid()}"
        try:
            runtime.mkdir(mode=0o700, exist_ok=True)
            if runtime.stat().st_uid == os.getuid():
                os.environ["XDG_RUNTIME_DIR"] = str(runtime)
        except OSError:  # only Mesa's complaint on stderr is at stake
            pass
    try:
        extras.set_instance_extras(backends=["Vulkan", "Metal", "DX12"])
    except Exception:  # noqa: BLE001 - set once per process; later calls may refuse
        pass
    return wgpu


def kernel_dir() -> Path:
    return source_root() / "webgpu"


class GpuDevice:
    """A WebGPU device and the buffers, kernels and submissions of the webgpu backend."""

    def __init__(
        self,
        *,
        portable_dot4: bool = False,
        max_binding: int | None = None,
        cooperative: bool | None = None,
    ) -> None:
        """``portable_dot4``: compute the integer dots byte by byte even where the
        adapter's compiler has the builtin; ``max_binding``: bind at most this many bytes
        (below the adapter's limit: the tests split weights that way); ``cooperative``:
        a workgroup an output row (kernels.wgsl mm_*_rows) rather than an invocation a
        row (None: for a GPU, not for a CPU adapter, which pays for every barrier)."""
        wgpu = _wgpu()
        self._wgpu = wgpu
        try:
            adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
        except Exception as exc:  # noqa: BLE001 - wgpu raises plain errors without one
            raise BackendError(f"{INSTALL_HINT} ({first_line(exc)})") from None
        if adapter is None:
            raise BackendError(INSTALL_HINT)
        info = adapter.info
        self.adapter = Adapter(
            str(info.get("device") or info.get("vendor") or "unknown adapter"),
            str(info.get("backend_type") or "?"),
            str(info.get("adapter_type") or "?"),
        )
        self.cooperative = self.adapter.kind != "CPU" if cooperative is None else cooperative
        limits = adapter.limits
        wanted = {
            name: limits[name]
            for name in (
                "max-storage-buffer-binding-size",
                "max-buffer-size",
                "max-compute-workgroup-storage-size",
            )
            if name in limits
        }
        self.device = adapter.request_device_sync(required_limits=wanted)
        self.max_binding = (
            int(
                min(
                    wanted.get("max-storage-buffer-binding-size", 128 << 20),
                    wanted.get("max-buffer-size", 1 << 31),
                )
            )
            // 4
            * 4
        )
        if max_binding is not None:
            self.max_binding = min(self.max_binding, max_binding // 4 * 4)
        self.param_stride = max(
            PARAM_WORDS * 4, int(limits.get("min-uniform-buffer-offset-alignment", 256))
        )
        self._kernels: dict[tuple[Any, ...], Kernel] = {}
        self._modules: dict[str, Any] = {}
        # how the integer dots are computed: the builtin, or "portable"
        self.dot4 = "portable" if portable_dot4 else "dot4I8Packed"
        self._layouts: dict[tuple[str, ...], Any] = {}
        usage = wgpu.BufferUsage
        self._params = self.device.create_buffer(  # the dispatches' parameter blocks
            size=PARAM_BLOCKS * self.param_stride, usage=usage.UNIFORM | usage.COPY_DST
        )
        self._staging: Any = None
        self._staging_size = 0
        self._dummy = self.storage(16)
        self.lock = threading.RLock()

    @property
    def dummy(self) -> Any:
        """A small buffer bound where a kernel's binding is not read (no scales, no xs)."""
        return self._dummy

    # ---- buffers ------------------------------------------------------------------------
    def storage(self, nbytes: int) -> Any:
        """A storage buffer of at least ``nbytes`` (rounded up to whole words, plus one where
        a binding still holds it: the kernels may read a word past a row's last byte, and
        robust access makes such a read harmless where there is no word more)."""
        usage = self._wgpu.BufferUsage
        words = -(-nbytes // 4) * 4
        size = max(16, words + 4 if words + 4 <= self.max_binding else words)
        return self.device.create_buffer(
            size=size, usage=usage.STORAGE | usage.COPY_DST | usage.COPY_SRC
        )

    def write(self, buffer: Any, data: np.ndarray | bytes, offset: int = 0) -> None:
        raw = (
            memoryview(np.ascontiguousarray(data)).cast("B")
            if isinstance(data, np.ndarray)
            else data
        )
        if len(raw) % 4:  # the queue writes whole words
            raw = bytes(raw) + b"\0" * (-len(raw) % 4)
        if len(raw):
            self.device.queue.write_buffer(buffer, offset, raw)

    def upload(self, data: np.ndarray) -> Any:
        """A new storage buffer holding ``data``'s bytes."""
        buffer = self.storage(data.nbytes)
        self.write(buffer, data)
        return buffer

    # ---- kernels ------------------------------------------------------------------------
    def kernel(self, name: str, **constants: int) -> Kernel:
        """``name``'s pipeline with its override ``constants`` (the products: the weight
        format FMT and the rows an invocation computes, TILE), made once."""
        key = (name, *sorted(constants.items()))
        found = self._kernels.get(key)
        if found is None:
            kinds = PRODUCT_BINDINGS if KERNELS[name] == "kernels.wgsl" else ELEMENTWISE_BINDINGS
            layout = self._layout(kinds)
            try:
                module = self._module(KERNELS[name])
                compute: dict[str, Any] = {"module": module, "entry_point": name}
                if constants:
                    compute["constants"] = dict(constants)
                pipeline = self.device.create_compute_pipeline(
                    layout=self.device.create_pipeline_layout(bind_group_layouts=[layout]),
                    compute=compute,
                )
            except Exception as exc:  # noqa: BLE001 - a driver's shader compiler failed
                raise BackendError(
                    f"the webgpu kernel {name} does not compile on {self.adapter.describe()}: "
                    f"{first_line(exc)}"
                ) from None
            found = self._kernels[key] = Kernel(name, pipeline, layout)
        return found

    def _module(self, file: str) -> Any:
        """A source file's shader module; kernels.wgsl with the integer dot the adapter's
        compiler takes (the builtin, else the portable one, said in `features`)."""
        if file not in self._modules:
            source = (kernel_dir() / file).read_text()
            if file != "kernels.wgsl":
                self._modules[file] = self.device.create_shader_module(code=source)
            else:
                try:
                    if self.dot4 == "portable":
                        raise ValueError("portable dots asked for")
                    self._modules[file] = self.device.create_shader_module(
                        code=source + DOT4_BUILTIN
                    )
                except Exception:  # noqa: BLE001 - no dot4I8Packed in this compiler
                    self.dot4 = "portable"
                    self._modules[file] = self.device.create_shader_module(
                        code=source + DOT4_PORTABLE
                    )
        return self._modules[file]

    def features(self) -> str:
        """What `ps` says of how this adapter runs the kernels."""
        size = self.max_binding
        held = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        rows = "a workgroup" if self.cooperative else "an invocation"
        return (
            f"{rows} an output row, integer dots: {self.dot4}; a binding holds {held}, "
            "larger weights are split"
        )

    def _layout(self, kinds: tuple[str, ...]) -> Any:
        if kinds not in self._layouts:
            wgpu = self._wgpu
            entries = [
                {
                    "binding": k,
                    "visibility": wgpu.ShaderStage.COMPUTE,
                    "buffer": {
                        "type": wgpu.BufferBindingType.read_only_storage
                        if kind == "read"
                        else wgpu.BufferBindingType.storage
                    },
                }
                for k, kind in enumerate(kinds)
            ]
            entries.append(
                {
                    "binding": len(kinds),
                    "visibility": wgpu.ShaderStage.COMPUTE,
                    "buffer": {"type": wgpu.BufferBindingType.uniform, "has_dynamic_offset": True},
                }
            )
            self._layouts[kinds] = self.device.create_bind_group_layout(entries=entries)
        return self._layouts[kinds]

    def bind(self, kernel: Kernel, buffers: Sequence[Any]) -> Any:
        """A bind group of ``buffers`` (whole) and the parameter buffer, for ``kernel``."""
        entries = [{"binding": k, "resource": {"buffer": b}} for k, b in enumerate(buffers)]
        entries.append(
            {
                "binding": len(buffers),
                "resource": {"buffer": self._params, "offset": 0, "size": PARAM_WORDS * 4},
            }
        )
        return self.device.create_bind_group(layout=kernel.layout, entries=entries)

    # ---- running ------------------------------------------------------------------------
    def run(self, commands: Commands, result: Any = None, nbytes: int = 0) -> bytes:
        """Run ``commands`` in one compute pass; then ``nbytes`` of ``result`` (copied to a
        mapped buffer and waited for), or nothing."""
        if len(commands.params) > PARAM_BLOCKS:
            raise BackendError(
                f"{len(commands.params)} dispatches in one submission (at most {PARAM_BLOCKS})"
            )
        if commands.params:
            stride = self.param_stride // 4
            blocks = np.zeros((len(commands.params), stride), dtype=np.uint32)
            blocks[:, :PARAM_WORDS] = np.stack(commands.params)
            self.device.queue.write_buffer(self._params, 0, blocks)
        encoder = self.device.create_command_encoder()
        if commands.dispatches:
            compute = encoder.begin_compute_pass()
            for kernel, group, block, (gx, gy) in commands.dispatches:
                compute.set_pipeline(kernel.pipeline)
                compute.set_bind_group(0, group, [block * self.param_stride])
                compute.dispatch_workgroups(gx, gy)
            compute.end()
        if result is None or nbytes == 0:
            self.device.queue.submit([encoder.finish()])
            return b""
        staging = self._staging_buffer(nbytes)
        encoder.copy_buffer_to_buffer(result, 0, staging, 0, -(-nbytes // 4) * 4)
        self.device.queue.submit([encoder.finish()])
        staging.map_sync(self._wgpu.MapMode.READ, 0, self._staging_size)
        try:
            data = bytes(staging.read_mapped(0, -(-nbytes // 4) * 4))
        finally:
            staging.unmap()
        return data[:nbytes]

    def _staging_buffer(self, nbytes: int) -> Any:
        need = -(-nbytes // 4) * 4
        if self._staging is None or self._staging_size < need:
            usage = self._wgpu.BufferUsage
            self._staging_size = max(need, 2 * self._staging_size, 1 << 16)
            self._staging = self.device.create_buffer(
                size=self._staging_size, usage=usage.MAP_READ | usage.COPY_DST
            )
        return self._staging


# ---- probes -----------------------------------------------------------------------------
def read_probe(device: GpuDevice, nbytes: int, repeats: int = 5) -> float:
    """GB/s of the device reading its own memory (``read_sum`` over ``nbytes``, best of
    ``repeats``): the limit a weight product on it runs against."""
    n = min(nbytes, device.max_binding) // 4
    data = device.upload(np.ones(n, dtype=np.float32))
    kernel = device.kernel("read_sum")
    groups = 1024
    out = device.storage(groups * 256 * 4)
    commands = Commands()
    commands.add(
        kernel, device.bind(kernel, (data, device.dummy, out)), (n, 0, 0, 0, groups), groups
    )
    device.run(commands, out, 4)  # compiles, warms
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        device.run(commands, out, 4)
        best = min(best, time.perf_counter() - t0)
    return n * 4 / best / 1e9


def upload_probe(device: GpuDevice, nbytes: int, repeats: int = 3) -> float:
    """GB/s of copying host memory to the device (what a weight's first use costs)."""
    host = np.ones(min(nbytes, device.max_binding) // 4, dtype=np.float32)
    buffer = device.storage(host.nbytes)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        device.write(buffer, host)
        device.run(Commands(), buffer, 4)  # the write has landed once this returns
        best = min(best, time.perf_counter() - t0)
    return host.nbytes / best / 1e9


_opened: GpuDevice | None = None
_opening = threading.Lock()


def open_device() -> GpuDevice:
    """The process's WebGPU device (opened once: an adapter is slow to open and every
    backend object of the process shares it), or a BackendError naming what is missing."""
    global _opened
    with _opening:
        if _opened is None:
            _opened = GpuDevice()
        return _opened
