"""The HTTP API key need not live in config.toml (0644 under the usual umask: any local
user reads it; issue 45): `http_api_key_file` (refused when others can read it) or
$COLIBRI_HTTP_API_KEY, and a warning at start when config.toml holds a key others can read."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from daemon_helpers import Home, free_port

from colibrid.config import API_KEY_ENV, api_key_warning, load_settings
from colibrid.errors import ConfigError
from colibrid.paths import Paths


def paths_in(home: Path) -> Paths:
    return Paths(home=home, socket=home / "run" / "colibrid.sock")


def config(home: Path, text: str, mode: int = 0o644) -> Paths:
    paths = paths_in(home)
    paths.config.write_text(text)
    paths.config.chmod(mode)
    return paths


def key_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)


def test_the_key_from_a_private_file(tmp_path: Path) -> None:
    key_file(tmp_path / "api.key", "s3cret\n")
    paths = config(tmp_path, 'http_api_key_file = "api.key"\n')  # relative: to the home
    assert load_settings(paths).http_api_key == "s3cret"
    elsewhere = key_file(tmp_path / "elsewhere.key", "  other  \nignored\n")
    paths = config(tmp_path, f'http_api_key_file = "{elsewhere}"\n')
    assert load_settings(paths).http_api_key == "other"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_key_file_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    key_file(tmp_path / "api.key", "s3cret\n", mode)
    paths = config(tmp_path, 'http_api_key_file = "api.key"\n')
    with pytest.raises(ConfigError, match=r"api\.key is open to other users.*chmod 600"):
        load_settings(paths)


def test_a_key_file_that_is_empty_missing_or_not_a_file(tmp_path: Path) -> None:
    key_file(tmp_path / "empty.key", "\n")
    (tmp_path / "fifo.key").parent.mkdir(exist_ok=True)
    os.mkfifo(tmp_path / "fifo.key", 0o600)
    for name, needle in (
        ("empty.key", "first line"),
        ("absent.key", "No such file"),
        ("fifo.key", "not a regular file"),
    ):
        paths = config(tmp_path, f'http_api_key_file = "{name}"\n')
        with pytest.raises(ConfigError, match=needle):
            load_settings(paths)


def test_the_environment_overrides_and_both_keys_in_the_file_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = config(tmp_path, 'http_api_key = "from-file"\n', 0o600)
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert load_settings(paths).http_api_key == "from-env"
    key_file(tmp_path / "api.key", "k\n")
    paths = config(tmp_path, 'http_api_key = "a"\nhttp_api_key_file = "api.key"\n', 0o600)
    with pytest.raises(ConfigError, match="not both"):
        load_settings(paths)


def test_a_readable_config_holding_the_key_is_warned_about(tmp_path: Path) -> None:
    paths = config(tmp_path, 'http_api_key = "k"\n', 0o644)
    warning = api_key_warning(paths)
    assert warning and "mode 644" in warning and f"chmod 600 {paths.config}" in warning
    assert API_KEY_ENV in warning and "http_api_key_file" in warning
    assert api_key_warning(config(tmp_path, 'http_api_key = "k"\n', 0o600)) is None
    assert api_key_warning(config(tmp_path, 'http = "8080"\n', 0o644)) is None
    key_file(tmp_path / "api.key", "k\n")
    assert api_key_warning(config(tmp_path, 'http_api_key_file = "api.key"\n')) is None


def test_the_daemon_takes_the_key_from_a_file_and_warns_about_a_readable_one(
    chat_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/models"
    home = Home(tmp_path / "home", chat_model, http=f"127.0.0.1:{port}", shutdown_grace_s=1.0)
    key_file(home.path / "api.key", "from-the-file\n")
    with open(home.path / "config.toml", "a") as cfg:
        cfg.write('http_api_key_file = "api.key"\n')
    (home.path / "config.toml").chmod(0o644)
    try:
        started = home.colibrid("start")
        assert started.returncode == 0, started.stderr + home.log()
        assert "warning" not in started.stderr
        assert httpx.get(url, timeout=30).status_code == 401
        auth = {"authorization": "Bearer from-the-file"}
        assert httpx.get(url, headers=auth, timeout=30).status_code == 200
        assert home.colibrid("stop").returncode == 0

        text = (home.path / "config.toml").read_text()
        (home.path / "config.toml").write_text(
            text.replace('http_api_key_file = "api.key"', 'http_api_key = "in-the-config"')
        )
        started = home.colibrid("start")
        assert started.returncode == 0, started.stderr + home.log()
        assert "warning:" in started.stderr and "chmod 600" in started.stderr
        assert "other users can read it" in home.log()
    finally:
        home.close()
