"""The daemon computes on the backend its config names (the `backend` key, or
`colibrid start --backend`): on MLX it answers what it answers on the CPU kernels; on the
cuda backend (its kernels emulated on this CPU where there is no GPU) and on the webgpu
backend (a real WebGPU adapter: Mesa's lavapipe in CI) streamed experts with PILOT answer
what the resident model answers, a profile switch included, and in the i8 family they
answer what the CPU daemon answers, byte for byte; `colibri ps` names the adapter."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from daemon_helpers import Home, free_port, install_chat_tokenizer

from colibrid.backends.cuda_device import EMULATE_ENV
from colibrid.engine.backend import make_ops, mlx_installed
from colibrid.errors import BackendError
from colibrid.formats.quant import container_tensors, quantize
from colibrid.formats.weights import WeightFormat


def _answer(
    home: Home,
    *start_flags: str,
    backend: str | None = None,
    ps: list[str] | None = None,
    metrics_url: str | None = None,
    switch_profile: bool = False,
) -> str:
    """The daemon's answer; with ``switch_profile``, after warming the `code` profile and
    switching to it (pins and the device tier's promotion move), the same answer again."""
    result = home.colibrid("start", *start_flags)
    assert result.returncode == 0, result.stderr + home.log()
    try:
        asked = home.colibri("ask", "--max-tokens", "12", "What is the capital?")
        assert asked.returncode == 0, asked.stderr + home.log()
        if switch_profile:
            warm = home.colibri("profile", "warm", "code", "--limit", "2", "--max-tokens", "6")
            assert warm.returncode == 0, warm.stderr + home.log()
            use = home.colibri("profile", "use", "code")
            assert use.returncode == 0, use.stderr + home.log()
            again = home.colibri("ask", "--max-tokens", "12", "What is the capital?")
            assert again.stdout == asked.stdout, home.log()
            if backend in ("cuda", "webgpu"):  # the pinned experts went to the device tier
                assert f"hottest experts copied to the {backend} device tier" in home.log()
        if backend is None:
            backend = "mlx" if "mlx" in (*start_flags, home.settings.get("backend")) else "cpu"
        assert f"on the {backend} backend" in home.log()
        if ps is not None:
            shown = home.colibri("ps")
            assert shown.returncode == 0, shown.stderr
            ps.append(shown.stdout)
            if metrics_url is not None:
                ps.append(httpx.get(metrics_url, timeout=30).text)
        return asked.stdout
    finally:
        home.close()


@pytest.mark.skipif(not mlx_installed(), reason="mlx is not installed")
def test_daemon_on_mlx_answers_as_on_cpu(chat_model: Path, tmp_path: Path) -> None:
    on_cpu = _answer(Home(tmp_path / "cpu", chat_model, backend="cpu"))
    by_key = _answer(Home(tmp_path / "key", chat_model, backend="mlx"))
    by_flag = _answer(Home(tmp_path / "flag", chat_model), "--backend", "mlx")
    assert on_cpu.strip() and by_key == on_cpu and by_flag == on_cpu


def test_daemon_on_cuda_streams_experts_as_it_answers_resident(
    chat_model: Path, tmp_path: Path
) -> None:
    homes = []
    for name in ("resident", "streamed"):
        home = Home(tmp_path / name, chat_model, backend="cuda")
        home.env[EMULATE_ENV] = "1"  # the cuda backend's code and kernels, run on this CPU
        homes.append(home)
    shown: list[str] = []
    resident = _answer(homes[0], backend="cuda")
    http = f"127.0.0.1:{free_port()}"
    streamed = _answer(
        homes[1],
        *("--cache", "1", "--pilot", "on", "--pin", "all", "--vram-gb", "0.0025", "--http", http),
        backend="cuda",
        ps=shown,
        metrics_url=f"http://{http}/metrics",
        switch_profile=True,
    )
    assert resident.strip() and streamed == resident
    vram = next(line for line in shown[0].splitlines() if line.startswith("vram "))
    assert int(vram.split()[1]) > 0, shown[0]  # experts on the device
    # a tier the dense weights fit, its experts competing for the rest
    assert "GB of weights on cpu-emulated (CUDA) (budget 0.0025 GB)" in shown[0]
    assert "% of uses)" in shown[0] and "used once and not kept" in shown[0]
    metrics = dict(
        line.rsplit(" ", 1) for line in shown[1].splitlines() if not line.startswith("#")
    )
    assert 0.0 < float(metrics["colibri_vram_hit_rate"]) < 1.0
    assert float(metrics['colibri_tier_experts{tier="vram"}']) > 0


@pytest.fixture(scope="module")
def int_chat_model(oracle_checkpoint, tmp_path_factory) -> Path:  # noqa: ANN001
    """The chat model with integer experts (int4-g64 gates and ups, int8 downs): what the
    cuda backend computes on the device in the i8 family."""

    def as_container(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
        fmt = WeightFormat.Q8 if "down" in name else WeightFormat.Q4
        return container_tensors(name, quantize(w, fmt, 64))

    ref = oracle_checkpoint("glm4_moe", expert_container=as_container)
    model = tmp_path_factory.mktemp("int-chat") / "model"
    shutil.copytree(ref.out_dir, model)
    install_chat_tokenizer(model)
    return model


def test_daemon_in_the_i8_family_gives_the_cpu_answer_on_cuda(
    int_chat_model: Path, tmp_path: Path
) -> None:
    """`kernel_family = "i8"` (config key) or `--kernel-family i8`: the resident CPU daemon,
    and the cuda daemon (emulated) streaming its experts through a small device tier with
    those it passes through computed on the host, answer the same (i8 on cuda gives the
    CPU kernels' bits)."""
    chat_model = int_chat_model
    on_cpu = Home(tmp_path / "cpu", chat_model, kernel_family="i8")
    cpu_answer = _answer(on_cpu)
    assert "(i8 kernel family)" in on_cpu.log()
    on_cuda = Home(tmp_path / "cuda", chat_model, backend="cuda")
    on_cuda.env[EMULATE_ENV] = "1"
    shown: list[str] = []
    cuda_answer = _answer(
        on_cuda,
        *("--kernel-family", "i8", "--cache", "1", "--pin", "off", "--vram-gb", "0.0025"),
        backend="cuda",
        ps=shown,
    )
    assert cpu_answer.strip() and cuda_answer == cpu_answer
    assert "(i8 kernel family)" in on_cuda.log()
    assert "; on the cuda backend, i8 kernels" in shown[0], shown[0]  # colibri ps
    vram = next(line for line in shown[0].splitlines() if line.startswith("vram "))
    assert int(vram.split()[1]) > 0, shown[0]  # integer experts computed on the device


@pytest.mark.skipif(not mlx_installed(), reason="mlx is not installed")
def test_daemon_refuses_i8_on_mlx_in_one_line(chat_model: Path, tmp_path: Path) -> None:
    home = Home(tmp_path / "home", chat_model, backend="mlx", kernel_family="i8")
    result = home.colibrid("start")
    try:
        assert result.returncode != 0
        assert "the mlx backend computes the f32 kernel family only, not i8" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    finally:
        home.close()


def _webgpu_adapter() -> str | None:
    """Why the webgpu backend cannot run here (None: it can)."""
    try:
        make_ops("webgpu")
    except BackendError as exc:
        return str(exc)
    return None


NO_WEBGPU = _webgpu_adapter()


@pytest.mark.skipif(NO_WEBGPU is not None, reason=str(NO_WEBGPU))
def test_daemon_on_webgpu_streams_experts_as_it_answers_resident(
    chat_model: Path, tmp_path: Path
) -> None:
    """f32: the resident webgpu daemon, and one streaming its experts (one cached a layer,
    PILOT on, pins from a warmed profile it switches to) through a device tier smaller
    than the model, answer the same; `ps` names the adapter and the tier's hit rate."""
    on_cpu = _answer(Home(tmp_path / "cpu", chat_model, backend="cpu"))
    resident = _answer(Home(tmp_path / "resident", chat_model, backend="webgpu"), backend="webgpu")
    shown: list[str] = []
    http = f"127.0.0.1:{free_port()}"
    streamed = _answer(
        Home(tmp_path / "streamed", chat_model, backend="webgpu"),
        *("--cache", "1", "--pilot", "on", "--pin", "all", "--vram-gb", "0.0025", "--http", http),
        backend="webgpu",
        ps=shown,
        metrics_url=f"http://{http}/metrics",
        switch_profile=True,
    )
    assert resident.strip() and streamed == resident == on_cpu
    vram = next(line for line in shown[0].splitlines() if line.startswith("vram "))
    assert int(vram.split()[1]) > 0, shown[0]  # experts on the device
    assert "(Vulkan" in shown[0] or "(Metal" in shown[0] or "(DX12" in shown[0], shown[0]
    assert "% of uses)" in shown[0], shown[0]
    metrics = dict(
        line.rsplit(" ", 1) for line in shown[1].splitlines() if not line.startswith("#")
    )
    assert 0.0 < float(metrics["colibri_vram_hit_rate"]) < 1.0


@pytest.mark.skipif(NO_WEBGPU is not None, reason=str(NO_WEBGPU))
def test_daemon_in_the_i8_family_gives_the_cpu_answer_on_webgpu(
    int_chat_model: Path, tmp_path: Path
) -> None:
    """i8: the webgpu daemon streaming its integer experts through a small device tier
    (those it passes through computed on the host or copied) answers what the resident
    CPU daemon answers, byte for byte, before and after a profile switch."""
    cpu_answer = _answer(Home(tmp_path / "cpu", int_chat_model, kernel_family="i8"))
    shown: list[str] = []
    on_webgpu = Home(tmp_path / "webgpu", int_chat_model, backend="webgpu")
    webgpu_answer = _answer(
        on_webgpu,
        *("--kernel-family", "i8", "--cache", "1", "--pin", "all", "--vram-gb", "0.0025"),
        backend="webgpu",
        ps=shown,
        switch_profile=True,
    )
    assert cpu_answer.strip() and webgpu_answer == cpu_answer
    assert "; on the webgpu backend, i8 kernels" in shown[0], shown[0]
    vram = next(line for line in shown[0].splitlines() if line.startswith("vram "))
    assert int(vram.split()[1]) > 0, shown[0]  # integer experts computed on the device


@pytest.fixture(scope="module")
def low_bit_chat_model(oracle_checkpoint, tmp_path_factory) -> Path:  # noqa: ANN001
    """The chat model with its routed experts in a mix of precisions by expert, as a plan
    by heat stores them: Q2, Q3 and int4-g64 side by side (experts of one layer differ in
    byte size)."""

    def as_container(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
        expert = int(name.split(".experts.")[1].split(".")[0])
        fmt = (WeightFormat.Q2, WeightFormat.Q3, WeightFormat.Q4)[expert % 3]
        return container_tensors(name, quantize(w, fmt, 64))

    ref = oracle_checkpoint("glm4_moe", expert_container=as_container)
    model = tmp_path_factory.mktemp("low-bit-chat") / "model"
    shutil.copytree(ref.out_dir, model)
    install_chat_tokenizer(model)
    return model


@pytest.mark.skipif(NO_WEBGPU is not None, reason=str(NO_WEBGPU))
def test_daemon_streams_low_bit_experts_on_webgpu_with_the_cpu_answer(
    low_bit_chat_model: Path, tmp_path: Path
) -> None:
    """i8, experts stored in Q2, Q3 and int4-g64: the webgpu daemon streaming them (one
    cached a layer) through a device tier smaller than the experts answers what the
    resident CPU daemon answers, byte for byte."""
    cpu_answer = _answer(Home(tmp_path / "cpu", low_bit_chat_model, kernel_family="i8"))
    shown: list[str] = []
    webgpu_answer = _answer(
        Home(tmp_path / "webgpu", low_bit_chat_model, backend="webgpu"),
        *("--kernel-family", "i8", "--cache", "1", "--pin", "off", "--vram-gb", "0.0025"),
        backend="webgpu",
        ps=shown,
    )
    assert cpu_answer.strip() and webgpu_answer == cpu_answer
    vram = next(line for line in shown[0].splitlines() if line.startswith("vram "))
    assert int(vram.split()[1]) > 0, shown[0]  # experts computed on the device
