"""The Unix-socket listener, with the traps of trio issue #279 handled.

* One daemon per socket: an exclusive `flock` on a lock file beside the socket is held for
  the daemon's life (the kernel drops it when the process dies, even by SIGKILL), and a
  live socket is probed by connecting before anything is removed.
* A socket file left by a crashed daemon (no lock holder, connection refused) is stale and
  is removed; so is its pidfile.
* The socket's directory is 0700 and the socket 0600 (created under umask 0177).
* A file that cannot be made (a full disk, a read-only home) is named in the error.
* Out of file descriptors, accepting backs off and logs one line, not a traceback every
  100 ms (serve/accept.py).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from colibrid.errors import ColibriError
from colibrid.paths import Paths, persisting
from colibrid.serve.accept import accept_forever


class AlreadyRunning(ColibriError):
    code = "ALREADY_RUNNING"


def read_pid(paths: Paths) -> int | None:
    try:
        return int(paths.pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def claim(paths: Paths) -> int:
    """Take the daemon lock (returns its fd, keep it open) or raise AlreadyRunning."""
    paths.ensure()
    with persisting(paths.lockfile):
        fd = os.open(paths.lockfile, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            pid = read_pid(paths)
            raise AlreadyRunning(
                f"colibrid is already running on {paths.socket}"
                + (f" (pid {pid})" if pid else "")
                + "; `colibrid stop` stops it"
            ) from None
        raise ColibriError(f"cannot lock {paths.lockfile}: {exc.strerror or exc}") from None
    return fd


def lock_is_held(paths: Paths) -> bool:
    """Whether some process holds the daemon lock (i.e. a daemon is alive)."""
    try:
        fd = os.open(paths.lockfile, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def socket_answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def remove_stale(paths: Paths) -> None:
    """With the lock held: a leftover socket that does not answer and the pidfile go."""
    if paths.socket.exists() or paths.socket.is_symlink():
        if socket_answers(paths.socket):
            raise AlreadyRunning(f"another daemon answers on {paths.socket}")
        with persisting(paths.socket):
            paths.socket.unlink()
    with persisting(paths.pidfile):
        paths.pidfile.unlink(missing_ok=True)


def bind(path: Path) -> trio.socket.SocketType:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        raw.bind(str(path))
        os.chmod(path, 0o600)
        raw.listen(128)
    except OSError as exc:
        raw.close()
        raise ColibriError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    finally:
        os.umask(old)
    return trio.socket.from_stdlib_socket(raw)


async def serve_socket(
    path: Path,
    handler: Callable[[trio.SocketStream], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Bind, report readiness, serve connections until cancelled; removes the socket.
    Out of file descriptors, accepting backs off and logs one line (serve/accept.py)."""
    sock = bind(path)
    try:
        listener = trio.SocketListener(sock)
        async with listener, trio.open_nursery() as nursery:
            task_status.started(path)
            await accept_forever(listener, handler, nursery, what="SERVE connections")
    finally:
        path.unlink(missing_ok=True)
