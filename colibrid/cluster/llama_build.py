"""``colibri llama-build``: llama.cpp's RPC binaries, built from the pinned sources.

A llama.cpp RPC cluster is one ``ggml-rpc-server`` on each host and one ``llama-server
--rpc host:port,...`` in front (docs/beyond-one-machine.md). Both must come from the same
llama.cpp: the RPC wire format changes between versions. colibri already pins one
llama.cpp, the one inside the llama-cpp-python sdist that ``colibri bench peer`` runs
(:data:`colibrid.bench.llama_peer.PEER_VERSION`), so the cluster is built from the same
sources: pip fetches that sdist with its hash checked (no git, no other download), and
cmake builds only the two targets.

Why these flags: ``GGML_RPC`` is the point; ``GGML_NATIVE`` compiles for this CPU's
instruction set, so every host builds its own; no curl and no TLS (models are local
files, the cluster runs on a trusted network); no web UI (llama.cpp would download its
assets at build time, and colibri is the front door); static libraries, so the two
binaries are copied alone into the cache and the build tree is thrown away.

The result lives in a per-user cache (:func:`cache_dir`), written by the same rule as the
native kernels' cache: one build at a time under a lock, in a temporary folder renamed
into place, so an interrupted build leaves nothing a later run would take for finished;
a finished build is found and reused (the command is idempotent).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from colibrid.backends.native_build import locked
from colibrid.bench.llama_peer import PEER_VERSION
from colibrid.errors import ClusterError
from colibrid.file_hash import sha256_of

PACKAGE = "llama-cpp-python"
SDIST = f"llama_cpp_python-{PEER_VERSION}.tar.gz"
# The sdist pip downloads is held to this digest (pip's --require-hashes, or ours for
# --sdist FILE): the binaries are built from exactly these sources.
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SOURCE_DIR = f"llama_cpp_python-{PEER_VERSION}/vendor/llama.cpp"
RPC_SERVER = "ggml-rpc-server"
LLAMA_SERVER = "llama-server"
TARGETS = (RPC_SERVER, LLAMA_SERVER)
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_RPC=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)
STAMP = "build.json"
Progress = Callable[[str], None]


@dataclass(frozen=True)
class LlamaBinaries:
    """A finished build: the folder whose ``bin/`` holds both programs."""

    root: Path

    @property
    def rpc_server(self) -> Path:
        return self.root / "bin" / RPC_SERVER

    @property
    def llama_server(self) -> Path:
        return self.root / "bin" / LLAMA_SERVER


def cache_dir() -> Path:
    """``$COLIBRI_LLAMA_DIR`` if set, else ``$XDG_CACHE_HOME/colibri/llama.cpp-<version>-rpc``
    (``~/.cache`` without XDG_CACHE_HOME)."""
    env = os.environ.get("COLIBRI_LLAMA_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "colibri" / f"llama.cpp-{PEER_VERSION}-rpc"


def _identity() -> dict[str, object]:
    """What a build is of: a cached build made otherwise is rebuilt."""
    return {
        "llama_cpp_python": PEER_VERSION,
        "sdist_sha256": SDIST_SHA256,
        "cmake_flags": list(CMAKE_FLAGS),
        "targets": list(TARGETS),
        "machine": platform.machine(),
    }


def cached(root: Path | None = None) -> LlamaBinaries | None:
    """The finished build in ``root`` (default :func:`cache_dir`), or None."""
    found = LlamaBinaries(root or cache_dir())
    try:
        stamp = json.loads((found.root / STAMP).read_text())
    except (OSError, ValueError):
        return None
    if stamp.get("identity") != _identity():
        return None
    programs = (found.rpc_server, found.llama_server)
    return found if all(os.access(p, os.X_OK) for p in programs) else None


def missing_tools() -> str | None:
    """Why this machine cannot build (no cmake, no C++ compiler), or None."""
    if shutil.which("cmake") is None:
        return "cmake not found (Debian: apt install cmake)"
    cxx = os.environ.get("CXX")
    if cxx:
        return None if shutil.which(cxx) else f"CXX={cxx} not found"
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "no C++ compiler found (Debian: apt install g++)"
    return None


def _fetch_sdist(into: Path, log: Path) -> Path:
    """pip downloads the pinned sdist, its hash required."""
    req = into / "requirements.txt"
    req.write_text(f"{PACKAGE}=={PEER_VERSION} --hash=sha256:{SDIST_SHA256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
    cmd += ["--require-hashes", "-r", str(req), "-d", str(into), "--progress-bar", "off"]
    _run(cmd, log, "pip download")
    found = into / SDIST
    if not found.is_file():
        raise ClusterError(f"pip download left no {SDIST} in {into} (log: {log})")
    return found


def _extract(sdist: Path, into: Path) -> Path:
    """Only llama.cpp's sources (the sdist's vendor/llama.cpp), refusing unsafe paths."""
    prefix = SOURCE_DIR + "/"
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            if not members:
                raise ClusterError(f"{sdist} holds no {SOURCE_DIR}")
            tar.extractall(into, members=members, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise ClusterError(f"cannot unpack {sdist}: {exc}") from None
    return into / SOURCE_DIR


def _run(cmd: Sequence[str], log: Path, what: str, on_line: Progress | None = None) -> None:
    """Run a step, its output appended to ``log``; a failure quotes the log's last line."""
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        assert proc.stdout is not None
        last = ""
        for line in proc.stdout:
            out.write(line)
            if line.strip():
                last = line.strip()
            if on_line is not None:
                on_line(line)
        code = proc.wait()
    if code != 0:
        raise ClusterError(f"{what} failed (exit {code}): {last[:200]} (log: {log})")


_NINJA = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE = re.compile(r"^\[\s*(\d+)%\]")


class _StepMeter:
    """Turns the build tool's ``[n/N]`` (ninja) or ``[ p%]`` (make) lines into progress:
    rewritten in place on a terminal, every tenth in a pipe."""

    def __init__(self, say: Progress) -> None:
        self.say = say
        self.shown = -1

    def __call__(self, line: str) -> None:
        m = _NINJA.match(line)
        pct = int(100 * int(m[1]) / max(1, int(m[2]))) if m else None
        if pct is None and (m := _MAKE.match(line)):
            pct = int(m[1])
        if pct is None or pct == self.shown:
            return
        if sys.stderr.isatty():
            print(f"\rllama.cpp: compiling {pct:3d}%", end="", file=sys.stderr, flush=True)
            if pct == 100:
                print(file=sys.stderr)
        elif pct // 10 != self.shown // 10 or self.shown < 0:
            self.say(f"compiling {pct}%")
        self.shown = pct


def jobs_default() -> int:
    """Every core this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def build(
    *,
    jobs: int | None = None,
    sdist: Path | None = None,
    force: bool = False,
    say: Progress | None = None,
) -> LlamaBinaries:
    """The binaries, built unless a finished build is cached (``force``: rebuild)."""
    report = say or (lambda msg: print(f"llama.cpp: {msg}", file=sys.stderr, flush=True))
    final = cache_dir()
    if not force and (found := cached(final)):
        return found
    reason = missing_tools()
    if reason:
        raise ClusterError(f"cannot build llama.cpp's RPC binaries: {reason}")
    if sdist is not None and not sdist.is_file():
        raise ClusterError(f"no such file: {sdist}")
    base = final.parent
    with locked(base / (final.name + ".lock")):
        if not force and (found := cached(final)):
            return found
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp", dir=base))
        log = base / (final.name + ".log")
        log.write_text("")
        try:
            if sdist is None:
                report(f"downloading the {PACKAGE} {PEER_VERSION} sdist (pip, hash checked)")
                sdist = _fetch_sdist(tmp, log)
            elif sha256_of(sdist) != SDIST_SHA256:
                raise ClusterError(f"{sdist} is not the pinned {SDIST} (sha256 differs)")
            report(f"unpacking llama.cpp from {sdist.name}")
            source = _extract(sdist, tmp / "src")
            n = jobs or jobs_default()
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            report(f"configuring (cmake, {' '.join(CMAKE_FLAGS[1:4])})")
            tree = tmp / "build"
            _run(
                ["cmake", "-S", str(source), "-B", str(tree), *generator, *CMAKE_FLAGS],
                log,
                "cmake",
            )
            report(f"compiling {', '.join(TARGETS)} with {n} jobs (minutes; log: {log})")
            cmd = ["cmake", "--build", str(tree), "-j", str(n), "--target", *TARGETS]
            _run(cmd, log, "cmake --build", _StepMeter(report))
            out = tmp / "out"
            (out / "bin").mkdir(parents=True)
            for target in TARGETS:
                shutil.copy2(tree / "bin" / target, out / "bin" / target)
            seconds = time.monotonic() - started
            stamp = {"identity": _identity(), "jobs": n, "seconds": round(seconds, 1)}
            (out / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
            if final.exists():
                shutil.rmtree(final)
            os.rename(out, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        report(f"built in {seconds:.0f} s with {n} jobs: {final / 'bin'}")
    found = cached(final)
    assert found is not None
    return found


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri llama-build",
        description=(
            f"Build llama.cpp's RPC programs ({RPC_SERVER} for each host, {LLAMA_SERVER} "
            f"--rpc in front) from the llama.cpp sources the {PACKAGE} {PEER_VERSION} sdist "
            "carries (the llama.cpp `colibri bench peer` runs): pip downloads the sdist with "
            "its hash checked, cmake builds with -DGGML_RPC=ON -DGGML_NATIVE=ON (this CPU: "
            "build on every host). Needs cmake and a C++ compiler; takes minutes. The "
            f"programs are cached in {cache_dir()} ($COLIBRI_LLAMA_DIR moves it) and a "
            "second run reuses them. Prints the folder holding them on stdout."
        ),
    )
    p.add_argument("--jobs", "-j", type=int, default=None, help="compile jobs (default: cores)")
    p.add_argument(
        "--sdist",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"an already downloaded {SDIST} (offline; its sha256 is checked)",
    )
    p.add_argument("--force", action="store_true", help="rebuild even when a build is cached")
    return p


def main(argv: Sequence[str]) -> int:
    a = build_parser().parse_args(list(argv))
    if a.jobs is not None and a.jobs < 1:
        build_parser().error("--jobs must be at least 1")
    found = build(jobs=a.jobs, sdist=a.sdist, force=a.force)
    print(found.root / "bin")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
