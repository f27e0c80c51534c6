"""Where a remote model's API key lives, and reading it when a request needs it.

Never on a command line (other users read /proc/*/cmdline) and never in models/NAME
(a folder one lists and copies): config.toml's ``[remote.NAME]`` table names a key file
(``api_key_file``, refused when others can read it) or holds the key (``api_key``); with
no table, the file ``$COLIBRI_HOME/keys/NAME`` is used when it exists, which is where
``colibri pull URL --api-key-env VAR`` stores the key it read from the environment
(remote.keyfile).

Read per request, not at start: a model pulled (or a key changed) while the daemon runs
is answered with its key at once, and a key file is a few bytes.
"""

from __future__ import annotations

from pathlib import Path

from colibrid.config import read_key_file, tomllib
from colibrid.errors import ConfigError
from colibrid.paths import Paths
from colibrid.remote.keyfile import default_key_file


def _table(paths: Paths, name: str) -> dict[str, str] | None:
    """config.toml's [remote.NAME] (checked for shape when the daemon started)."""
    if not paths.config.is_file():
        return None
    try:
        values = tomllib.loads(paths.config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{paths.config}: {exc}") from None
    tables = values.get("remote")
    table = tables.get(name) if isinstance(tables, dict) else None
    return table if isinstance(table, dict) else None


def remote_key(paths: Paths, name: str) -> str | None:
    """The API key of the remote model `name`, or None when none is configured."""
    what = f"[remote.{name}] api_key_file"
    table = _table(paths, name)
    if table is not None and isinstance(table.get("api_key"), str):
        return table["api_key"].strip() or None
    if table is not None and isinstance(table.get("api_key_file"), str):
        return read_key_file(paths.home / Path(table["api_key_file"]).expanduser(), what)
    fallback = default_key_file(paths, name)
    if fallback.is_file() or fallback.is_symlink():
        return read_key_file(fallback, "the key file")
    return None


def where_keys_go(paths: Paths, name: str) -> str:
    """The one line that tells a user where to put a key."""
    return (
        f"put the key in {default_key_file(paths, name)} (chmod 600), set [remote.{name}] "
        f"api_key_file in {paths.config}, or pull again with --api-key-env VAR"
    )
