"""The ``$COLIBRI_HOME`` layout and atomic writes of persistent state.

::

    $COLIBRI_HOME/            (default ~/.colibri)
      config.toml             settings (colibrid/config.py)
      models/NAME/            checkpoints addressed by name
      profiles/MODEL/NAME.coli_usage   usage histories (upstream's text format)
      kv/MODEL/N.npz          the prompt cache kept across restarts (engine/kv_files.py)
      colibrid.log            the detached daemon's log
      run/                    0700: colibrid.sock (0600), colibrid.pid, colibrid.lock
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from colibri_protocol import home as protocol_home


@dataclass(frozen=True)
class Paths:
    home: Path
    socket: Path

    @classmethod
    def from_env(cls, socket: str | Path | None = None) -> Paths:
        home = protocol_home.colibri_home()
        sock = Path(socket).expanduser() if socket else protocol_home.socket_path(home)
        return cls(home=home, socket=sock)

    @property
    def config(self) -> Path:
        return self.home / "config.toml"

    @property
    def models(self) -> Path:
        return self.home / "models"

    @property
    def profiles(self) -> Path:
        return self.home / "profiles"

    @property
    def kv(self) -> Path:
        return self.home / "kv"

    @property
    def log(self) -> Path:
        return self.home / "colibrid.log"

    @property
    def run(self) -> Path:
        """Private directory of the socket; pidfile and lock sit beside the socket."""
        return self.socket.parent

    @property
    def pidfile(self) -> Path:
        return self.run / (self.socket.stem + ".pid")

    @property
    def lockfile(self) -> Path:
        return self.run / (self.socket.stem + ".lock")

    def ensure(self) -> None:
        """Create the layout; the socket's directory is private to the user (0700).

        Our own run directory is (re)made private; a directory given with `--socket`
        elsewhere is never chmod-ed (it may be /tmp): if others can enter it, refuse.
        """
        self.home.mkdir(parents=True, exist_ok=True)
        self.run.mkdir(mode=0o700, parents=True, exist_ok=True)
        mode = self.run.stat().st_mode & 0o777
        if mode & 0o077:
            if self.run.resolve() != (self.home / "run").resolve():
                from colibrid.errors import ConfigError

                raise ConfigError(
                    f"the socket directory {self.run} is open to other users "
                    f"(mode {mode:o}); put the socket in a private directory"
                )
            os.chmod(self.run, 0o700)


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write via temp file + fsync + rename so a crash never leaves a half-written file."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    with atomic_file(path) as handle:
        handle.write(data)


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file that appears at `path` whole, or not at all: written to a temp file
    beside it, fsynced, renamed over `path` when the block ends without an exception."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
