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


def config_values(path: Path) -> dict[str, object]:
    """The keys of ``config.toml`` at `path` as a client reads them ({} when it is absent
    or unreadable: the daemon, which reads it whole, is the one that reports a bad file)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _configured_socket(path: Path) -> Path | None:
    value = config_values(path).get("socket")
    return Path(value).expanduser() if isinstance(value, str) and value else None
