"""The daemon computes on the backend its config names (the `backend` key, or
`colibrid start --backend`): on MLX it answers what it answers on the CPU kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
from daemon_helpers import Home

from colibrid.engine.backend import mlx_installed


def _answer(home: Home, *start_flags: str) -> str:
    result = home.colibrid("start", *start_flags)
    assert result.returncode == 0, result.stderr + home.log()
    try:
        asked = home.colibri("ask", "--max-tokens", "12", "What is the capital?")
        assert asked.returncode == 0, asked.stderr + home.log()
        backend = "mlx" if "mlx" in (*start_flags, home.settings.get("backend")) else "cpu"
        assert f"on the {backend} backend" in home.log()
        return asked.stdout
    finally:
        home.close()


@pytest.mark.skipif(not mlx_installed(), reason="mlx is not installed")
def test_daemon_on_mlx_answers_as_on_cpu(chat_model: Path, tmp_path: Path) -> None:
    on_cpu = _answer(Home(tmp_path / "cpu", chat_model, backend="cpu"))
    by_key = _answer(Home(tmp_path / "key", chat_model, backend="mlx"))
    by_flag = _answer(Home(tmp_path / "flag", chat_model), "--backend", "mlx")
    assert on_cpu.strip() and by_key == on_cpu and by_flag == on_cpu
