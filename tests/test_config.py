"""config.toml and the $COLIBRI_HOME layout: typos are errors, writes are atomic."""

from __future__ import annotations

from pathlib import Path

import pytest

from colibrid.config import load_settings, resolve_model
from colibrid.errors import ConfigError
from colibrid.paths import Paths, atomic_write


def paths_in(tmp_path: Path) -> Paths:
    return Paths(home=tmp_path, socket=tmp_path / "run" / "colibrid.sock")


def test_settings_from_toml_and_overrides(tmp_path: Path) -> None:
    paths = paths_in(tmp_path)
    atomic_write(paths.config, 'default_model = "tiny"\nmax_queue = 3\n')
    settings = load_settings(paths, ram_gb=2)
    assert (settings.default_model, settings.max_queue, settings.ram_gb) == ("tiny", 3, 2)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("max_qeue = 3", "unknown setting"),
        ("max_queue = 'x'", "wrong type"),
        ("max_queue = ", "config.toml"),
    ],
)
def test_bad_config_names_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    paths = paths_in(tmp_path)
    paths.config.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_settings(paths)


def test_model_resolution(tmp_path: Path) -> None:
    paths = paths_in(tmp_path)
    with pytest.raises(ConfigError, match="colibri pull demo"):
        resolve_model(paths, None)
    (paths.models / "demo").mkdir(parents=True)
    assert resolve_model(paths, None) == (paths.models / "demo").absolute()
    (paths.models / "tiny").mkdir(parents=True)
    assert resolve_model(paths, "tiny") == (paths.models / "tiny").absolute()
    assert resolve_model(paths, str(paths.models)) == paths.models.resolve()
    with pytest.raises(ConfigError, match="neither"):
        resolve_model(paths, "absent")


def test_private_run_dir_and_foreign_socket_dir(tmp_path: Path) -> None:
    paths = paths_in(tmp_path)
    paths.ensure()
    assert paths.run.stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="open to other users"):
        Paths(home=tmp_path, socket=shared / "s.sock").ensure()
    assert shared.stat().st_mode & 0o777 == 0o777  # never chmod-ed


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "a" / "state.txt"
    atomic_write(target, "one")
    atomic_write(target, b"two")
    assert target.read_text() == "two"
    assert [p.name for p in target.parent.iterdir()] == ["state.txt"]


def test_the_config_reference_is_generated_from_the_one_definition() -> None:
    """docs/configuration.md is `colibri config --markdown` (it cannot drift from the
    code), every key is in it, and the example file's defaults load as the defaults."""
    from colibrid.config import FIELDS, Settings, tomllib
    from colibrid.config_reference import markdown, toml_example

    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    assert doc == markdown(), "regenerate: colibri config --markdown > docs/configuration.md"
    for key in FIELDS:
        assert f"| `{key}` |" in doc and FIELDS[key].metadata["help"]
    uncommented = "\n".join(
        line[2:]
        for line in toml_example().splitlines()
        if line.startswith("# ") and " = " in line and not line.endswith("= ...")
    )
    assert Settings(**tomllib.loads(uncommented)) == Settings()


def test_colibri_config_lists_every_key_and_what_the_file_sets(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from colibrid.config import FIELDS

    (tmp_path / "config.toml").write_text("max_active = 2\n")
    env = {**os.environ, "COLIBRI_HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "colibri_cli", "config"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert all(key in out.stdout for key in FIELDS)
    assert "[set: 2]" in out.stdout
