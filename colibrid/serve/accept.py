"""Accepting connections when file descriptors run out.

Every connection costs the daemon one descriptor. At the limit, `accept` fails with
EMFILE (ENFILE: the whole system's table; ENOMEM, ENOBUFS) while the connection waits in
the backlog, so the listening socket stays readable and a naive loop spins. trio's
`serve_listeners` sleeps 100 ms and logs each failure with a traceback: ten tracebacks
a second into a log nobody rotates (340 KB in 27 s, issue 45). Here:

- `raise_fd_limit` lifts the soft RLIMIT_NOFILE to the hard limit (capped) at start, so
  the limit is rarely reached at all;
- `accept_forever` (the SERVE socket's loop) backs off from 0.1 s to 1 s while accept
  fails and logs one line without a traceback at most every `LOG_EVERY_S`, then one line
  when connections are accepted again;
- `AcceptErrorFilter`, on trio's `trio.serve_listeners` logger (hypercorn's HTTP accept
  loop is trio's), drops the traceback and lets one such line through per `LOG_EVERY_S`
  with the count of those left out.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger("colibrid.accept")

CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
LOG_EVERY_S = 30.0
BACKOFF_S = (0.1, 1.0)  # first wait after a failed accept, and the longest
FD_CAP = 65536  # enough connections and files for anything a daemon does
MACOS_OPEN_MAX = 10240  # where the hard limit is "unlimited" but the kernel's is not


def raise_fd_limit(cap: int = FD_CAP) -> tuple[int, int]:
    """Lift the soft open-file limit to the hard one (at most `cap`); returns (before,
    after). Never lowers it, never fails: a limit that cannot move stays as it is."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft, soft
    for want in (cap if hard == resource.RLIM_INFINITY else min(hard, cap), MACOS_OPEN_MAX):
        if want <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            continue
        return soft, want
    return soft, soft


def describe_errno(code: int | None) -> str:
    """'EMFILE (Too many open files)'."""
    if code is None:
        return "an error"
    return f"{errno.errorcode.get(code, str(code))} ({os.strerror(code)})"


class Throttle:
    """Lets an event through at most once per `every_s`; counts the others."""

    def __init__(self, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self.clock = clock
        self.next_at: float | None = None
        self.held = 0  # events not let through since the last one that was

    def allow(self) -> bool:
        now = self.clock()
        if self.next_at is not None and now < self.next_at:
            self.held += 1
            return False
        self.next_at = now + self.every_s
        return True

    def take_held(self) -> int:
        held, self.held = self.held, 0
        return held


class AcceptErrorFilter(logging.Filter):
    """For trio's `serve_listeners` logger: its accept-capacity errors, one line per
    `every_s` without the traceback; other records pass untouched."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        super().__init__()
        self.throttle = Throttle(every_s)

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("accept returned"):
            return True
        if not self.throttle.allow():
            return False
        record.exc_info = record.exc_text = None
        record.stack_info = None
        held = self.throttle.take_held()
        tail = f"; {held} left out" if held else ""  # no "%": the record's args still fit
        record.msg = f"{record.msg} (one such line per {self.throttle.every_s:g} s{tail})"
        return True


def install_accept_filter() -> None:
    """Put `AcceptErrorFilter` on trio's logger (once)."""
    trio_log = logging.getLogger("trio.serve_listeners")
    if not any(isinstance(f, AcceptErrorFilter) for f in trio_log.filters):
        trio_log.addFilter(AcceptErrorFilter())


async def _run_handler(
    stream: trio.SocketStream, handler: Callable[[trio.SocketStream], Awaitable[None]]
) -> None:
    try:
        await handler(stream)
    finally:
        await trio.aclose_forcefully(stream)


async def accept_forever(
    listener: trio.SocketListener,
    handler: Callable[[trio.SocketStream], Awaitable[None]],
    nursery: trio.Nursery,
    *,
    what: str = "connections",
    throttle: Throttle | None = None,
) -> None:
    """Accept connections and run `handler` for each in `nursery`, until cancelled; when
    descriptors run out, back off and say so in one line (see the module docstring)."""
    throttle = throttle or Throttle()
    wait_s, failing = BACKOFF_S[0], 0
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno not in CAPACITY_ERRNOS:
                raise
            failing += 1
            if throttle.allow():
                held = throttle.take_held()
                log.warning(
                    "cannot accept %s: %s; retrying with back-off up to %g s%s",
                    what,
                    describe_errno(exc.errno),
                    BACKOFF_S[1],
                    f" ({held} more failures since the last line)" if held else "",
                )
            await trio.sleep(wait_s)
            wait_s = min(wait_s * 2, BACKOFF_S[1])
            continue
        if failing:
            log.info("accepting %s again (%d accepts failed meanwhile)", what, failing)
            wait_s, failing = BACKOFF_S[0], 0
            throttle.next_at = None
        nursery.start_soon(_run_handler, stream, handler)
