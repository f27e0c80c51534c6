"""Files shipped from the repository's ``packaging/`` folder (the ``colibri_packaging``
distribution folder): service unit templates and shell completions.

``packaging/`` holds no Python, so it is a namespace folder; its first real directory on
``__path__`` is the one to read (an editable install also lists a path hook there, which
``importlib.resources`` trips over).
"""

from __future__ import annotations

from pathlib import Path


def packaging_dir() -> Path:
    import colibri_packaging

    for entry in colibri_packaging.__path__:
        if Path(entry).is_dir():
            return Path(entry)
    raise FileNotFoundError("the colibri_packaging folder is missing from this install")


def packaged_file(relative: str) -> Path:
    return packaging_dir() / relative
