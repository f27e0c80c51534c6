"""`colibrid start | stop | status | run`: the daemon's life cycle from the shell.

`run` is the foreground daemon (service managers; SIGTERM is graceful). `start` runs
`colibrid run` detached (own session, stdin closed, output appended to the log) and waits
on a readiness pipe until the model is loaded and the socket bound, then prints where it
listens; if the daemon dies first its error is shown. What makes the wait long that the
user would otherwise not see (the first run's native build) comes through the pipe as a
`NOTE` line, which `start` prints on stderr as it arrives. `stop` sends SIGTERM to the pid in
the pidfile and waits until the daemon lock is released. `status` asks the daemon.

A start that cannot write its state (a full disk, a read-only home) fails with one line
naming the file and the reason, in the foreground and through the readiness pipe alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from colibrid.config import (
    PILOT_HELP,
    add_backend_flag,
    add_kernel_family_flag,
    add_speculate_flags,
    api_key_warning,
    load_settings,
    resolve_model,
)
from colibrid.errors import ColibriError
from colibrid.logfile import setup_logging
from colibrid.paths import Paths, atomic_write, persisting
from colibrid.serve import socket_server


def configure_daemon(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", metavar="NAME|DIR", help="model to serve (default: default_model in config.toml)"
    )
    p.add_argument(
        "--ram-gb",
        type=float,
        metavar="N",
        help="memory budget (default: 88%% of available memory)",
    )
    p.add_argument(
        "--cache",
        type=int,
        metavar="N",
        help="experts per layer in the RAM cache (overrides the budget)",
    )
    p.add_argument(
        "--pin",
        choices=("auto", "all", "off"),
        help="pins from the active profile: auto (AUTOPIN, the default: none below 5,000 "
        "recorded selections, then more as the profile grows), all (as many used experts as "
        "the budget holds), off",
    )
    p.add_argument(
        "--pilot",
        choices=("on", "off", "auto"),
        help=PILOT_HELP,
    )
    p.add_argument("--io-threads", type=int, metavar="N", help="reader threads (0 = no pool)")
    p.add_argument("--direct", choices=("on", "off"), help="O_DIRECT / F_NOCACHE expert reads")
    add_speculate_flags(p)
    add_backend_flag(p, config_key=True)
    add_kernel_family_flag(p, config_key=True)
    p.add_argument(
        "--socket", metavar="PATH", help="socket path (default $COLIBRI_HOME/run/colibrid.sock)"
    )
    p.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="serve the OpenAI/Anthropic HTTP API and, at /, a page to chat and watch the "
        "memory tiers (a bare PORT binds 127.0.0.1; config.toml key `http`)",
    )


def configure_start(p: argparse.ArgumentParser) -> None:
    configure_daemon(p)
    p.add_argument(
        "--wait",
        type=float,
        default=600.0,
        metavar="S",
        help="how long to wait for the model to load",
    )


def configure_run(p: argparse.ArgumentParser) -> None:
    configure_daemon(p)
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)


def configure_stop(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", metavar="PATH")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S")


def configure_status(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", metavar="PATH")
    p.add_argument("--json", action="store_true", help="the raw STATUS reply")


def _say(ready_fd: int | None, line: str) -> None:
    if ready_fd is None:
        print(f"colibrid: {line}", file=sys.stderr, flush=True)
        return
    try:
        os.write(ready_fd, (line + "\n").encode())
    except OSError:
        pass


def _fail(ready_fd: int | None, exc: ColibriError) -> None:
    """Tell the waiting `colibrid start` why; in the foreground the caller prints it."""
    if ready_fd is not None:
        _say(ready_fd, f"ERROR {exc}")


def run(args: argparse.Namespace) -> int:
    """The daemon in the foreground; returns when stopped."""
    import trio

    from colibrid import daemon
    from colibrid.backends import native_build
    from colibrid.backends.base import KernelFamily, require_family
    from colibrid.engine.backend import make_ops, resolve

    ready_fd = args.ready_fd
    try:
        paths = Paths.from_env(args.socket)
        settings = load_settings(
            paths,
            default_model=args.model,
            ram_gb=args.ram_gb,
            socket=args.socket,
            cache=args.cache,
            pin=args.pin,
            pilot=args.pilot,
            io_threads=args.io_threads,
            http=args.http,
            direct=None if args.direct is None else args.direct == "on",
            speculate=args.speculate,
            draft_max=args.draft_max,
            backend=args.backend,
            vram_gb=args.vram_gb,
            kernel_family=args.kernel_family,
        )
        # a backend this machine lacks (or one refusing the family) fails before the socket
        family = KernelFamily(settings.kernel_family)
        # detached, the build's own line goes to the log: tell the waiting `start`
        detached = ready_fd is not None and resolve(settings.backend, family) != "mlx"
        if detached and native_build.needs_build():
            _say(ready_fd, f"NOTE {native_build.BUILD_NOTE}")
        ops = make_ops(settings.backend, family)
        require_family(ops.name, ops.families, family)
        model_dir = resolve_model(paths, settings.default_model)
        lock_fd = socket_server.claim(paths)
    except ColibriError as exc:
        _fail(ready_fd, exc)
        raise
    setup_logging(paths.log)  # rotated when it is the detached daemon's log (logfile.py)
    if (warning := api_key_warning(paths)) is not None:
        logging.getLogger("colibrid").warning(warning)
    try:
        socket_server.remove_stale(paths)
        with persisting(paths.pidfile):
            atomic_write(paths.pidfile, f"{os.getpid()}\n")

        def ready(where: str) -> None:
            if ready_fd is None:
                _say(None, f"listening on {where} (pid {os.getpid()})")
            else:
                _say(ready_fd, f"READY {os.getpid()} {where}")

        trio.run(daemon.serve, settings, paths, model_dir, ready)
    except ColibriError as exc:
        _fail(ready_fd, exc)
        raise
    except OSError as exc:
        if exc.filename is None:
            _say(ready_fd, f"ERROR {type(exc).__name__}: {exc}")
            raise
        error = ColibriError(f"{exc.filename}: {exc.strerror or exc}")  # one line, named
        _fail(ready_fd, error)
        raise error from exc
    except BaseException as exc:
        _say(ready_fd, f"ERROR {type(exc).__name__}: {exc}")
        raise
    finally:
        paths.pidfile.unlink(missing_ok=True)
        os.close(lock_fd)
    return 0


def _wait_for_starting(paths: Paths, timeout_s: float) -> None:
    """Another `colibrid start` holds the lock and is loading: wait until its daemon
    answers (or gives up, releasing the lock), so two starts converge on one daemon."""
    deadline = time.monotonic() + timeout_s
    while socket_server.lock_is_held(paths) and not socket_server.socket_answers(paths.socket):
        if time.monotonic() > deadline:
            raise ColibriError(
                f"a daemon is starting on {paths.socket} but did not answer within "
                f"{timeout_s:g} s; see {paths.log}"
            )
        time.sleep(0.1)


def start(args: argparse.Namespace) -> int:
    paths = Paths.from_env(args.socket)
    paths.ensure()  # raises PersistError naming the folder it cannot make
    if (warning := api_key_warning(paths)) is not None:
        print(f"colibrid: warning: {warning}", file=sys.stderr)
    if socket_server.lock_is_held(paths):
        _wait_for_starting(paths, args.wait)
    if socket_server.lock_is_held(paths):
        pid = socket_server.read_pid(paths)
        raise socket_server.AlreadyRunning(
            f"colibrid is already running on {paths.socket}"
            + (f" (pid {pid})" if pid else "")
            + "; `colibrid stop` stops it"
        )
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "colibrid", "run", "--ready-fd", str(write_fd)]
    for flag, value in (
        ("--model", args.model),
        ("--ram-gb", args.ram_gb),
        ("--socket", args.socket),
        ("--cache", args.cache),
        ("--pin", args.pin),
        ("--pilot", args.pilot),
        ("--io-threads", args.io_threads),
        ("--direct", args.direct),
        ("--http", args.http),
        ("--speculate", args.speculate),
        ("--draft-max", args.draft_max),
        ("--backend", args.backend),
        ("--vram-gb", args.vram_gb),
        ("--kernel-family", args.kernel_family),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    try:
        log_fd = open_log(paths)
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            pass_fds=(write_fd,),
            start_new_session=True,
        )
    except OSError as exc:
        os.close(read_fd)
        raise ColibriError(f"cannot run {sys.executable}: {exc.strerror or exc}") from None
    finally:
        os.close(log_fd)
        os.close(write_fd)
    lines = _read_ready(read_fd, args.wait)
    ready = next((line for line in lines if line.startswith("READY ")), None)
    if ready is None:
        errors = [line[6:] for line in lines if line.startswith("ERROR ")]
        if proc.poll() is None and not errors:
            raise ColibriError(
                f"colibrid did not become ready within {args.wait:g} s "
                f"(pid {proc.pid} still loading; see {paths.log})"
            )
        message = errors[-1] if errors else f"the daemon exited; see {paths.log}"
        if "already running" in message:  # another start won the lock a moment earlier
            _wait_for_starting(paths, args.wait)
            raise socket_server.AlreadyRunning(message)
        raise ColibriError(message)
    _, pid, where = ready.split(" ", 2)
    print(f"colibrid: listening on {where} (pid {pid}; log {paths.log})")
    for url in page_urls(where):
        print(f"colibrid: chat and the memory tiers, live, in a browser: {url}")
    return 0


def page_urls(where: str) -> list[str]:
    """The page's address on each HTTP listener named in a READY line's
    ``SOCKET http=URL[,URL] model=NAME`` (none without `http`)."""
    for word in where.split():
        if word.startswith("http="):
            return [url.rstrip("/") + "/" for url in word[5:].split(",") if url]
    return []


def open_log(paths: Paths) -> int:
    """The log for appending, private (0600: it quotes paths and errors of the user's
    requests); a log an older version made 0644 is tightened."""
    with persisting(paths.log):
        fd = os.open(paths.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
    except OSError:
        pass  # not ours to change (a shared log): keep logging to it
    return fd


def _read_ready(fd: int, timeout_s: float) -> list[str]:
    """The daemon's readiness lines; each `NOTE` line is printed on stderr as it comes."""
    import select

    deadline, data, noted = time.monotonic() + timeout_s, b"", 0
    try:
        while b"READY " not in data and (left := deadline - time.monotonic()) > 0:
            if not select.select([fd], [], [], left)[0]:
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
            complete = data.decode(errors="replace").split("\n")[:-1]
            for line in complete[noted:]:
                if line.startswith("NOTE "):
                    print(f"colibrid: {line[5:]}", file=sys.stderr, flush=True)
            noted = len(complete)
    finally:
        os.close(fd)
    return data.decode(errors="replace").splitlines()


def stop(args: argparse.Namespace) -> int:
    paths = Paths.from_env(args.socket)
    pid = socket_server.read_pid(paths)
    if not socket_server.lock_is_held(paths):
        print("colibrid: not running")
        return 0
    if pid is None:
        raise ColibriError(
            f"colibrid holds {paths.lockfile} but wrote no pidfile yet (still starting?); try again"
        )
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while socket_server.lock_is_held(paths):
        if time.monotonic() > deadline:
            raise ColibriError(f"colibrid (pid {pid}) did not stop within {args.timeout:g} s")
        time.sleep(0.05)
    print(f"colibrid: stopped (pid {pid})")
    return 0


def status(args: argparse.Namespace) -> int:
    paths = Paths.from_env(args.socket)
    if not socket_server.lock_is_held(paths):
        print("colibrid: not running")
        return 3
    body = _status_body(paths)
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        http = ", ".join(body.get("http") or []) or "off"
        print(
            f"colibrid: running (pid {body['pid']}), model {body['model']}, "
            f"up {body['uptime_s']:.0f} s, profile {body['profile']}, "
            f"socket {paths.socket}, http {http}"
        )
    return 0


def _status_body(paths: Paths) -> dict:
    """The daemon's STATUS reply; a socket error is one line (printing stays outside, so
    a reader of stdout that left is not reported as an unreachable daemon)."""
    from colibri_protocol.codec import FrameDecoder, response_payload_length
    from colibri_protocol.messages import Reply, parse_response

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(str(paths.socket))
        sock.sendall(b"STATUS\n")
        decoder = FrameDecoder(response_payload_length)
        while True:
            data = sock.recv(65536)
            if not data:
                raise ColibriError("the daemon closed the connection")
            for frame in decoder.feed(data):
                reply = parse_response(frame) if not isinstance(frame, Exception) else None
                if isinstance(reply, Reply):
                    return reply.body
    except OSError as exc:
        raise ColibriError(f"cannot reach the daemon on {paths.socket}: {exc}") from None
    finally:
        sock.close()
