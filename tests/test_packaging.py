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
    }
