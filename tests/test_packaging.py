"""pyproject.toml lists every Python package folder, so a wheel install is complete."""

from __future__ import annotations

import sys
from pathlib import Path

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


def test_every_file_in_packaging_ships() -> None:
    """`colibri service` and `colibri completion` users get packaging/'s files from a wheel."""
    from fnmatch import fnmatch

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = config["package-data"]["colibri_packaging"]
    files = [
        p.relative_to(ROOT / "packaging").as_posix()
        for p in (ROOT / "packaging").rglob("*")
        if p.is_file()
    ]
    assert {"systemd/colibrid.service", "completions/_colibri"} <= set(files)
    unshipped = [f for f in files if not any(fnmatch(f, g) for g in globs)]
    assert not unshipped, f"packaging/ files no package-data glob ships: {unshipped}"
