"""`colibri ask` pulls the demo model on first use, and only then (fast, no download)."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import numpy as np
import pytest

from colibri_cli import client


@pytest.fixture
def calls(monkeypatch, tmp_path: Path) -> list:
    monkeypatch.setenv("COLIBRI_HOME", str(tmp_path))
    monkeypatch.delenv("COLIBRI_NO_PULL", raising=False)
    seen: list = []

    def fake_run(cmd, **kw):  # type: ignore[no-untyped-def]
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(client.subprocess, "run", fake_run)
    return seen


def test_pulls_when_nothing_is_configured(calls: list) -> None:
    err = io.StringIO()
    client.ensure_demo(None, err)
    assert calls and calls[0][-3:] == ["colibri_cli", "pull", "demo"][-3:]
    assert "pulling the demo model" in err.getvalue()


def test_no_pull_with_a_configured_model_or_a_present_demo(
    calls: list, tmp_path: Path, monkeypatch
) -> None:
    client.ensure_demo("/some/model", io.StringIO())
    monkeypatch.setenv("COLIBRI_NO_PULL", "1")
    client.ensure_demo(None, io.StringIO())
    monkeypatch.delenv("COLIBRI_NO_PULL")
    (tmp_path / "config.toml").write_text('default_model = "big"\n')
    client.ensure_demo(None, io.StringIO())
    assert calls == []
    (tmp_path / "config.toml").unlink()
    (tmp_path / "models" / "demo").mkdir(parents=True)
    (tmp_path / "models" / "demo" / "manifest.json").write_text("{}")
    client.ensure_demo(None, io.StringIO())
    assert calls == []


def test_reverse_permute_inverts_llama_cpp_permute() -> None:
    from colibrid.convert.gguf_llama import reverse_permute

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp convert_hf_to_gguf
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    assert np.array_equal(reverse_permute(permute(w, 6), 6), w)


def test_router_rows_are_deterministic_and_unsaturated() -> None:
    from colibrid.convert.demo import N_EXPERTS, router_rows

    rng = np.random.default_rng(1)
    gate = rng.standard_normal((96, 32)).astype(np.float32)
    ln = np.ones(32, dtype=np.float32)
    a, b = router_rows(gate, ln, 0), router_rows(gate, ln, 0)
    assert a.shape == (N_EXPERTS, 32) and np.array_equal(a, b)
    norms = np.linalg.norm(a, axis=1)
    assert 0.5 < np.median(norms) < 2.0
