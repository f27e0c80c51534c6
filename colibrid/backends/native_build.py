"""Compile colibri's C kernels with cffi (API mode) on first use and load them.

The extension is built once per (sources, flags, compiler, Python ABI) into a per-user
cache directory, so an installed wheel needs no compiler at install time and a source
checkout rebuilds automatically when a .c/.h file changes:

  $COLIBRI_NATIVE_DIR/<hash>              (if set)
  $XDG_CACHE_HOME/colibri/native/<hash>   (else)
  ~/.cache/colibri/native/<hash>          (else)

Two processes starting together serialise on an fcntl lock; the build happens in a
temporary directory that is atomically renamed into place, so a crash never leaves a
half-written module that a later run would load.

A build takes a while (figures in docs/performance.md) and used to pass in silence, so
it says what it is doing in one line on stderr (never stdout, which may be a pipe into a
program): finished on the same line with its time when stderr is a terminal. A detached
daemon's stderr is its log, so it asks `needs_build` first and tells the waiting
`colibrid start` through its readiness pipe (control.py), which prints the same line.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.resources
import importlib.util
import os
import platform
import shlex
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from colibrid.errors import NativeBuildError

MODULE_NAME = "_colibri_native"
CFLAGS = ["-O3", "-std=c11", "-fno-strict-aliasing", "-ffp-contract=off", "-pthread"]
INSTALL_HINT = (
    "a C compiler (gcc or clang) is needed to build colibri's native kernels: install one "
    "(Debian/Ubuntu: 'sudo apt install build-essential'; Fedora: 'sudo dnf install gcc'; "
    "macOS: 'xcode-select --install') or point CC at it"
)

BUILD_NOTE = "compiling the native kernels for this machine (once per version of colibri)"

_loaded: ModuleType | None = None


def source_root() -> Path:
    """The folder holding include/colibri.h: the installed package, else the checkout."""
    try:
        spec = importlib.util.find_spec("colibri_native")
        places = list(spec.submodule_search_locations or []) if spec else []
        if spec and not places:
            places = [str(importlib.resources.files("colibri_native"))]
        for place in places:
            root = Path(place)
            if (root / "include" / "colibri.h").is_file():
                return root
    except Exception:  # not installed, a namespace/editable oddity, a zip: use the checkout
        pass
    return Path(__file__).resolve().parents[2] / "native"


def _machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def c_sources(root: Path) -> list[Path]:
    """Portable sources plus the ISA folder matching this machine (x86 or arm)."""
    src = root / "src"
    files = sorted(src.glob("*.c")) + sorted((src / "ref").glob("*.c"))
    machine = _machine()
    if machine == "x86_64":
        files += sorted((src / "x86").glob("*.c"))
    elif machine == "aarch64":
        files += sorted((src / "arm").glob("*.c"))
    return files


def _headers(root: Path) -> list[Path]:
    return sorted((root / "include").glob("*.h")) + sorted((root / "src").rglob("*.h"))


def compiler() -> list[str]:
    """The C compiler command distutils will use: $CC, else Python's configured CC."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def build_hash(root: Path) -> str:
    """Hash of everything that changes the binary: sources, flags, compiler, ABI."""
    h = hashlib.sha256()
    for path in c_sources(root) + _headers(root):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    h.update(" ".join(CFLAGS + compiler()).encode())
    h.update((sys.implementation.cache_tag or "").encode())
    h.update(str(sysconfig.get_config_var("EXT_SUFFIX")).encode())
    h.update(_machine().encode())
    return h.hexdigest()[:20]


def cache_base() -> Path:
    env = os.environ.get("COLIBRI_NATIVE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "colibri" / "native"


def cdef_text(root: Path) -> str:
    """colibri.h without preprocessor lines: the header doubles as the cffi cdef."""
    lines = (root / "include" / "colibri.h").read_text().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _find_module(folder: Path) -> Path | None:
    found = sorted(folder.glob(MODULE_NAME + "*.so")) + sorted(folder.glob(MODULE_NAME + "*.pyd"))
    return found[0] if found else None


def _compile(root: Path, out_dir: Path) -> None:
    """Run cffi + distutils in out_dir; any failure becomes a NativeBuildError."""
    if shutil.which(compiler()[0]) is None:
        raise NativeBuildError(f"C compiler {compiler()[0]!r} not found: {INSTALL_HINT}")
    import cffi  # local: only needed when building

    ffi = cffi.FFI()
    ffi.cdef(cdef_text(root))
    ffi.set_source(
        MODULE_NAME,
        '#include "colibri.h"\n',
        sources=[str(p) for p in c_sources(root)],
        include_dirs=[str(root / "include"), str(root / "src")],
        extra_compile_args=CFLAGS,
        extra_link_args=["-pthread"],
        libraries=["m"],
    )
    try:
        ffi.compile(tmpdir=str(out_dir), verbose=False)
    except Exception as exc:  # distutils raises several unrelated types
        last = str(exc).strip().splitlines()[-1:] or ["unknown error"]
        raise NativeBuildError(
            f"building native kernels failed: {last[0]} ({INSTALL_HINT})"
        ) from exc


def needs_build(root: Path | None = None) -> bool:
    """Whether loading the kernels will compile them first (this version's first run)."""
    final = cache_base() / build_hash(root or source_root())
    return not (final.is_dir() and _find_module(final))


def _announce() -> float:
    """The build's one line on stderr, left open on a terminal for `_finished`."""
    terminal = sys.stderr.isatty()
    print(f"colibri: {BUILD_NOTE}...", end="" if terminal else "\n", file=sys.stderr, flush=True)
    return time.monotonic()


def _finished(started: float, built: bool) -> None:
    """End the terminal's open line: the time taken, or nothing (the error follows)."""
    if sys.stderr.isatty():
        done = f" done in {time.monotonic() - started:.0f} s" if built else ""
        print(done, file=sys.stderr, flush=True)


def build(root: Path | None = None) -> Path:
    """Return the path of the built extension module, compiling it if needed."""
    root = root or source_root()
    base = cache_base()
    final = base / build_hash(root)
    found = _find_module(final) if final.is_dir() else None
    if found:
        return found
    with locked(base / (final.name + ".lock")):
        found = _find_module(final) if final.is_dir() else None
        if found:
            return found
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp", dir=base))
        started, built = _announce(), False
        try:
            _compile(root, tmp)
            if _find_module(tmp) is None:
                raise NativeBuildError(f"build produced no {MODULE_NAME} module ({INSTALL_HINT})")
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            built = True
        finally:
            _finished(started, built)
            shutil.rmtree(tmp, ignore_errors=True)
    found = _find_module(final)
    assert found is not None
    return found


def load() -> ModuleType:
    """Build if needed and import the extension by path (once per process)."""
    global _loaded
    if _loaded is None:
        path = build()
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        if spec is None or spec.loader is None:
            raise NativeBuildError(f"cannot load native module {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded = module
    return _loaded
