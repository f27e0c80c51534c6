"""The ``$COLIBRI_HOME`` layout and atomic writes of persistent state.

::

    $COLIBRI_HOME/            (default ~/.colibri)
      config.toml             settings (colibrid/config.py)
      models/NAME/            checkpoints addressed by name
      profiles/MODEL/NAME.coli_usage   usage histories (upstream's text format)
      kv/MODEL/N.npz          the prompt cache kept across restarts (engine/kv_files.py)
      colibrid.log            the detached daemon's log (rotated at 10 MiB: .1 to .3)
      run/                    0700: colibrid.sock (0600), colibrid.pid, colibrid.lock

Everything colibri writes there is private to the user: what the profiles and the prompt
cache hold spells out what was asked (directories 0700, files 0600, the log 0600).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from colibri_protocol import home as protocol_home

from colibrid.errors import PersistError

log = logging.getLogger("colibrid.paths")

# atomic_file's temp files: ".{target name}." + mkstemp's 8 random characters + ".tmp".
ORPHAN_TEMP = re.compile(r"^\.(?P<target>.+)\.[a-z0-9_]{8}\.tmp$")
ORPHAN_AGE_S = 5.0  # older than any atomic write in flight (a write takes milliseconds)


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

        Whoever owns or can write the socket's directory can move the socket aside and
        answer in the daemon's place, or plant a pidfile: a directory owned by another
        user, or writable by group or others, is refused with what to fix. Our own run
        directory that others can merely enter (an older version's 0755) is made 0700; a
        directory given with `--socket` elsewhere is never chmod-ed (it may be /tmp).
        """
        with persisting(self.home):
            self.home.mkdir(parents=True, exist_ok=True)
        with persisting(self.run):
            self.run.mkdir(mode=0o700, parents=True, exist_ok=True)
            ours = self.run.resolve() == (self.home / "run").resolve()
            if check_private_dir(self.run, may_tighten=ours):
                os.chmod(self.run, 0o700)


def check_private_dir(directory: Path, *, may_tighten: bool) -> bool:
    """Refuse (ConfigError, one line saying what to fix) a directory that another user
    owns or that group or others can write; True when it only needs a chmod 0700 (others
    may enter it) and `may_tighten` allows that."""
    from colibrid.errors import ConfigError

    st = directory.stat()
    me = os.geteuid()
    if st.st_uid != me:
        raise ConfigError(
            f"the socket directory {directory} belongs to uid {st.st_uid}, not to this user "
            f"(uid {me}), who could move the socket aside: remove it (its owner or root can) "
            "or put the socket in a directory of yours, then start again"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise ConfigError(
            f"the socket directory {directory} is open to other users (mode {mode:o}: they "
            f"can write in it, so move the socket aside): check what it holds, then "
            f"`chmod 700 {directory}` and start again"
        )
    if mode & 0o077 and not may_tighten:
        raise ConfigError(
            f"the socket directory {directory} is open to other users (mode {mode:o}); "
            "put the socket in a private directory"
        )
    return bool(mode & 0o077)


@contextmanager
def persisting(path: Path) -> Iterator[None]:
    """Turn an OSError while writing `path` into a PersistError naming it: the user sees
    "cannot write PATH: No space left on device" instead of a bare errno."""
    try:
        yield
    except OSError as exc:
        raise PersistError.of(path, exc) from exc


def make_private_dirs(directory: Path) -> None:
    """Create `directory` and its missing parents 0700 (`mkdir(parents=True)` would make
    the parents with the umask's mode, e.g. a 0755 profiles/ above a 0700 profiles/MODEL)."""
    missing = []
    for each in (directory, *directory.parents):
        if each.is_dir():
            break
        missing.append(each)
    for each in reversed(missing):
        each.mkdir(mode=0o700, exist_ok=True)


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write via temp file + fsync + rename so a crash never leaves a half-written file."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    with atomic_file(path) as handle:
        handle.write(data)


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file that appears at `path` whole, or not at all: written to a temp file
    beside it, fsynced, renamed over `path` when the block ends without an exception.

    The file is 0600 (mkstemp's mode, kept by the rename) and directories made for it are
    0700. A kill -9 mid-write leaves the temp file behind: `remove_orphan_temps` clears
    those at the next daemon start. Errors stay OSError; `persisting` names the path."""
    make_private_dirs(path.parent)
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


def remove_orphan_temps(
    home: Path, *, lock_held: bool = False, min_age_s: float = ORPHAN_AGE_S
) -> list[Path]:
    """Remove the temp files atomic writes left when killed (see ORPHAN_TEMP) from
    the home, profiles/*/, kv/*/ and run/; returns what was removed.

    Only files of atomic_file's exact pattern go (never a user's file, a link or a folder,
    never anything under models/). A temp file may belong to a write in flight, so only
    those older than `min_age_s` go, unless the caller holds the daemon lock: the daemon
    is then the only writer of this state, and at its start it writes nothing yet."""
    folders = [home, home / "run"]
    for tree in (home / "profiles", home / "kv"):
        folders.append(tree)
        folders.extend(sorted(_subdirs(tree)))
    now, removed = time.time(), []
    for folder in folders:
        for path in _entries(folder, _is_orphan_temp):
            try:
                if not lock_held and now - path.lstat().st_mtime < min_age_s:
                    continue
                path.unlink()
            except FileNotFoundError:
                continue  # its writer finished (renamed or removed it) meanwhile
            except OSError as exc:
                log.warning("cannot remove the orphan temp file %s: %s", path, exc)
                continue
            removed.append(path)
    return removed


def _is_orphan_temp(entry: os.DirEntry) -> bool:
    return bool(ORPHAN_TEMP.match(entry.name)) and entry.is_file(follow_symlinks=False)


def make_state_private(paths: Paths) -> int:
    """Tighten the modes of state written by older versions (or by other tools, such as
    `colibri profile show`'s heat maps): profiles/, kv/ and their MODEL/ folders 0700,
    their files and the log 0600. Returns how many modes changed; one that cannot change
    is logged (a start is not refused for it)."""
    wanted: list[tuple[Path, int]] = []
    for tree in (paths.profiles, paths.kv):
        if not tree.is_dir():
            continue
        wanted.append((tree, 0o700))
        wanted.extend((f, 0o600) for f in _files(tree))
        for folder in _subdirs(tree):
            wanted.append((folder, 0o700))
            wanted.extend((f, 0o600) for f in _files(folder))
    if paths.log.is_file() and not paths.log.is_symlink():
        wanted.append((paths.log, 0o600))
    changed = 0
    for path, mode in wanted:
        try:
            if stat.S_IMODE(path.stat().st_mode) & 0o077:
                os.chmod(path, mode)
                changed += 1
        except OSError as exc:
            log.warning("cannot make %s private: %s", path, exc)
    return changed


def _subdirs(folder: Path) -> Iterator[Path]:
    """Real subdirectories (a link to a folder elsewhere is not walked into)."""
    return _entries(folder, lambda entry: entry.is_dir(follow_symlinks=False))


def _files(folder: Path) -> Iterator[Path]:
    return _entries(folder, lambda entry: entry.is_file(follow_symlinks=False))


def _entries(folder: Path, keep: Callable[[os.DirEntry], bool]) -> Iterator[Path]:
    """The entries of `folder` that `keep` accepts; none when it cannot be listed."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if keep(entry):
            yield Path(entry.path)
