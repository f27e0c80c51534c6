"""`colibri llama-build`: refusals in one line, nothing left behind by a refused build,
and a finished build found again at once (idempotent). The build itself runs in
test_rpc_cluster.py's fixture (or .ci/run before pytest)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colibrid.cluster.llama_build import SDIST, cached, missing_tools


def llama_build(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri_cli", "llama-build", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_sdist_that_is_not_the_pinned_one_is_refused(tmp_path: Path) -> None:
    if missing_tools():
        pytest.skip(f"cannot build here: {missing_tools()}")
    fake = tmp_path / SDIST
    fake.write_bytes(b"not llama.cpp")
    cache = tmp_path / "cache" / "llama"
    r = llama_build("--sdist", str(fake), env={"COLIBRI_LLAMA_DIR": str(cache)})
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        f"colibri llama-build: error: {fake} is not the pinned {SDIST} (sha256 differs)"
    )
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not cache.exists()  # no half-built folder a later run could take for finished
    assert not [p for p in cache.parent.iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sdist", "/no/such.tar.gz"], "no such file: /no/such.tar.gz"),
        (["--jobs", "0"], "--jobs must be at least 1"),
    ],
)
def test_refusals(tmp_path: Path, args: list[str], message: str) -> None:
    r = llama_build(*args, env={"COLIBRI_LLAMA_DIR": str(tmp_path / "llama")})
    assert r.returncode in (1, 2) and message in r.stderr and "Traceback" not in r.stderr


def test_a_finished_build_is_found_again_at_once() -> None:
    found = cached()
    if found is None:
        pytest.skip("llama.cpp's RPC binaries are not built (`colibri llama-build`)")
    started = time.monotonic()
    r = llama_build()
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(found.root / "bin")
    assert r.stderr == "" and time.monotonic() - started < 30
    for program in (found.rpc_server, found.llama_server):
        assert os.access(program, os.X_OK)
