"""The NEON kernels, built for aarch64 and run under emulation (qemu-user) against the
portable reference: the integer (I8) family bit for bit, the float family to tolerance,
every weight format including FP4 (tests/native/neon_check.c). The NEON file is only
compiled on ARM, so without this an x86 machine would never even build it; skips without
an aarch64 cross compiler and qemu-aarch64 (Debian: gcc-aarch64-linux-gnu,
libc6-dev-arm64-cross, qemu-user; .ci/run installs them)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"


@pytest.mark.skipif(
    shutil.which(CC) is None or shutil.which(QEMU) is None,
    reason=f"needs {CC} and {QEMU} (an aarch64 cross compiler and qemu-user)",
)
def test_neon_kernels_match_the_reference_under_emulation(tmp_path: Path) -> None:
    src = ROOT / "native" / "src"
    sources = [
        *sorted(src.glob("*.c")),
        *sorted((src / "ref").glob("*.c")),
        *sorted((src / "arm").glob("*.c")),
        ROOT / "tests" / "native" / "neon_check.c",
    ]
    exe = tmp_path / "neon_check"
    flags = ["-O2", "-std=c11", "-fno-strict-aliasing", "-ffp-contract=off", "-pthread", "-static"]
    build = subprocess.run(
        [
            CC,
            *flags,
            f"-I{ROOT / 'native' / 'include'}",
            f"-I{src}",
            *map(str, sources),
            "-lm",
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([QEMU, str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-1000:]
    assert " 0 failures" in run.stdout
