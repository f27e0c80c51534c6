"""Where a client finds the daemon: ``$COLIBRI_HOME`` and the socket inside it.

Part of the contract rather than of either side, so `colibri` (which must not import
colibrid) and `colibrid` agree on it. ``COLIBRI_SOCKET`` overrides the socket path; a
``socket = "..."`` line in ``config.toml`` does too (the daemon reads the full config).
"""

from __future__ import annotations

import os
from pathlib import Path

SOCKET_NAME = "colibrid.sock"


def colibri_home() -> Path:
    return Path(os.environ.get("COLIBRI_HOME") or Path.home() / ".colibri").expanduser()


def run_dir(home: Path | None = None) -> Path:
    """The private (0700) directory holding the socket, pidfile and lock."""
    return (home or colibri_home()) / "run"


def socket_path(home: Path | None = None) -> Path:
    env = os.environ.get("COLIBRI_SOCKET")
    if env:
        return Path(env).expanduser()
    home = home or colibri_home()
    configured = _configured_socket(home / "config.toml")
    return configured or run_dir(home) / SOCKET_NAME


def _configured_socket(path: Path) -> Path | None:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            return None
    try:
        value = tomllib.loads(path.read_text(encoding="utf-8")).get("socket")
    except (OSError, ValueError):
        return None
    return Path(value).expanduser() if isinstance(value, str) and value else None
