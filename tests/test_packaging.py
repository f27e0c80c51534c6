"""pyproject.toml lists every Python package folder, so a wheel install is complete."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("colibrid", "colibri_cli")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert on_disk <= listed, f"missing from pyproject packages: {sorted(on_disk - listed)}"
    assert config["package-dir"] == {
        "colibri_protocol": "protocol",
        "colibri_native": "native",
        "colibri_profiles": "profiles",
        "colibri_packaging": "packaging",
    }


@pytest.mark.parametrize(
    "package, folder",
    [
        ("colibri_packaging", "packaging"),  # `colibri service` and `colibri completion`
        ("colibri_native", "native"),  # the C, CUDA and WGSL sources built or read at run time
        ("colibrid.http", "colibrid/http/page"),  # the page the daemon serves at /
    ],
)
def test_every_data_file_ships(package: str, folder: str) -> None:
    """A wheel install gets every file these folders hold: each is matched by one of the
    package's package-data globs (a WGSL kernel missing from a wheel breaks --backend webgpu)."""
    from fnmatch import fnmatch

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = config["package-data"][package]
    base = ROOT / Path(*package.split(".")) if package.startswith("colibrid") else ROOT / folder
    files = [
        p.relative_to(base).as_posix()
        for p in (ROOT / folder).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    ]
    assert files, f"{folder} holds nothing"
    unshipped = [f for f in files if not any(fnmatch(f, g) for g in globs)]
    assert not unshipped, f"{folder} files no package-data glob of {package} ships: {unshipped}"
