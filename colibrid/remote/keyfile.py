"""The key file `colibri pull URL --api-key-env VAR` keeps for a remote model:
``$COLIBRI_HOME/keys/NAME`` (0600), written atomically and taken away with the model.

Apart from remote.keys (which resolves a request's key from config.toml first) because
removing a model (colibrid.installed) needs only where the file is, not config: the
model's installed files are remote.json and this one, and `colibri rm` leaves neither.
A [remote.NAME] table in config.toml, and a key file it names, are the user's and stay.
"""

from __future__ import annotations

from pathlib import Path

from colibrid.paths import Paths, atomic_write

KEYS_DIR = "keys"


def default_key_file(paths: Paths, name: str) -> Path:
    """Where `pull --api-key-env` stores the key of the remote model `name`."""
    return paths.home / KEYS_DIR / name


def store_key(paths: Paths, name: str, key: str) -> Path:
    """Write `key` as the key of `name` (0600, atomically); the file written."""
    path = default_key_file(paths, name)
    atomic_write(path, key.strip() + "\n")
    return path


def forget_key(paths: Paths, name: str) -> Path | None:
    """Delete the stored key of `name` (a link loses only itself); the file deleted, or
    None when there was none. Other OSErrors (a keys/ folder not writable) propagate."""
    path = default_key_file(paths, name)
    try:
        path.unlink()
    except FileNotFoundError:
        return None
    return path
