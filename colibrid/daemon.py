"""colibrid's nursery tree: read the indentation of `serve` to see the process.

::

    serve
    └── daemon nursery
        ├── signal watcher (SIGTERM/SIGINT -> stopping)
        ├── engine host (owns the one engine thread)
        ├── scheduler (admission, fairness)
        ├── remote runner (a task per request to a remote model: serve/remote_runs.py)
        ├── the model slot: load the default model (on the engine thread), then
        │   ├── keep_alive watcher (unloads a model idle for its keep_alive)
        │   └── profile saver (periodic atomic writes of the loaded model's profiles)
        └── front nursery
            ├── socket server: accept loop (serve/accept.py) -> one task per connection
            └── http (optional): hypercorn.trio.serve(ASGI app) -> one task per connection

Beside the tree, the grammar service (serve/grammars.py) starts its compiler processes on
the first request with a grammar and ends them at shutdown.

Readiness (`ready`) is reported only after the default model is loaded and the socket is
bound. Later a request may load another installed model when the daemon is idle, and
`colibri stop` or keep_alive may unload it (serve/models.py). Shutdown: refuse new
requests, let running ones finish within `shutdown_grace_s`, cancel the rest (freed within
one token), wait until their last lines are written, then cancel the rest of the tree.

A disk that fills (or fails) never stops the daemon: a periodic save that fails is logged
once per distinct error and tried again next period; the final save at shutdown (or an
unload) tries the profiles and the prompt cache each, logs what was not saved, and never
raises.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import trio

if sys.version_info < (3, 11):  # trio brings the backport there
    from exceptiongroup import BaseExceptionGroup

from colibrid.config import Settings, speculation
from colibrid.errors import ColibriError, ConfigError
from colibrid.http.app import serve_http
from colibrid.http.listen import bind_http, fd_binds
from colibrid.paths import Paths, make_state_private, remove_orphan_temps
from colibrid.remote.spec import read_spec
from colibrid.serve.accept import install_accept_filter, raise_fd_limit
from colibrid.serve.faults import FaultPlan
from colibrid.serve.grammars import GrammarLimits, GrammarService
from colibrid.serve.host import EngineHost
from colibrid.serve.models import ModelSlot
from colibrid.serve.remote_runs import RemoteRunner
from colibrid.serve.roofline import refresh_when_idle
from colibrid.serve.scheduler import Scheduler
from colibrid.serve.session import serve_connection
from colibrid.serve.socket_server import serve_socket
from colibrid.serve.state import DaemonState

log = logging.getLogger("colibrid")


def tidy_home(paths: Paths) -> None:
    """At start, with the daemon lock held: remove the temp files a killed write left
    (this daemon is the only writer, and it has written nothing yet) and make state
    written by older versions private."""
    removed = remove_orphan_temps(paths.home, lock_held=True)
    if removed:
        log.info("removed %d orphan temp file(s) of interrupted writes", len(removed))
    fixed = make_state_private(paths)
    if fixed:
        log.info("made %d state folder(s) or file(s) private (0700/0600)", fixed)


def _reason(exc: BaseException) -> str:
    """A write failure in words: PersistError's message names the file already."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f" ({exc.filename})" if exc.filename else "")
    return str(exc) or type(exc).__name__


async def watch_signals(stopping: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s: stopping", signal.Signals(signum).name)
            stopping.set()


async def save_profiles(models: ModelSlot, every_s: float) -> None:
    """Save the loaded model's profiles every `every_s`; a failure is logged when it
    first happens or changes (not every period while the disk stays full) and when
    saving works again."""
    failing: str | None = None
    while True:
        await trio.sleep(every_s)
        loaded = models.current
        if loaded is None:
            continue
        try:
            await trio.to_thread.run_sync(loaded.book.save_all)
        except (OSError, ColibriError) as exc:
            if _reason(exc) != failing:
                failing = _reason(exc)
                log.warning("profiles not saved (trying again every %g s): %s", every_s, failing)
            continue
        if failing is not None:
            log.info("profiles saved again")
            failing = None


async def drain(scheduler: Scheduler, grace_s: float, remotes: RemoteRunner | None = None) -> None:
    """In-flight requests end (within the grace) or are cancelled; queued ones fail.
    Requests to remote models are drained alongside."""
    scheduler.close_nowait()
    if remotes is not None:
        remotes.close_nowait()

    async def idle() -> None:
        await scheduler.wait_idle()
        if remotes is not None:
            await remotes.wait_idle()

    with trio.move_on_after(grace_s):
        await idle()
    scheduler.cancel_running()
    if remotes is not None:
        remotes.cancel_running()
    with trio.move_on_after(5.0):  # a client that stopped reading must not hold us
        await idle()


def raise_limits() -> None:
    """More file descriptors (each connection takes one) and quiet accept errors when
    they run out anyway (serve/accept.py)."""
    before, after = raise_fd_limit()
    if after != before:
        log.info("open-file limit raised from %d to %d", before, after)
    else:
        log.info("open-file limit %d", after)
    install_accept_filter()


async def serve(
    settings: Settings, paths: Paths, model_dir: Path, ready: Callable[[str], None]
) -> None:
    if read_spec(model_dir) is not None:
        raise ConfigError(
            f"{model_dir.name} is a remote model: the daemon serves it beside a local one, "
            "so default_model (or --model) must name a local model; ask for "
            f"{model_dir.name} with `--model {model_dir.name}`"
        )
    # a refused or taken address is one line, before the model loads
    http_sockets = bind_http(settings) if settings.http else []
    raise_limits()
    tidy_home(paths)
    host = EngineHost(
        None,
        None,
        max_conversations=settings.max_conversations,
        prompt_cache=settings.prompt_cache,
        faults=FaultPlan(
            settings.debug_layer_delay_s, settings.debug_fail_prompt, settings.debug_fail_after
        ),
        speculate=speculation(settings),
    )
    grammars = GrammarService(GrammarLimits.of(settings))
    stopping = trio.Event()
    models: ModelSlot | None = None
    try:
        async with trio.open_nursery() as daemon:
            daemon.start_soon(watch_signals, stopping)
            await daemon.start(host.serve)
            scheduler = Scheduler(
                host, max_queue=settings.max_queue, max_active=settings.max_active
            )
            await daemon.start(scheduler.serve)
            remotes = RemoteRunner(paths, max_running=settings.max_queue + settings.max_active)
            await daemon.start(remotes.serve)
            models = ModelSlot(settings, paths, host, scheduler)
            try:  # a load or a front that fails must still end the engine thread
                log.info("loading %s", model_dir)
                await models.switch(model_dir)
                state = DaemonState(host, scheduler, models, grammars=grammars, remotes=remotes)
                daemon.start_soon(save_profiles, models, settings.profile_save_s)
                daemon.start_soon(models.watch)
                daemon.start_soon(refresh_when_idle, host, settings.roofline_refresh_s)
                async with trio.open_nursery() as front:
                    await front.start(
                        serve_socket, paths.socket, lambda stream: serve_connection(stream, state)
                    )
                    where = str(paths.socket)
                    if settings.http:  # the OpenAI/Anthropic API: same scheduler and state
                        binds = fd_binds(http_sockets)
                        urls = await front.start(serve_http, state, settings, binds)
                        state.http_urls = list(urls)
                        where += " http=" + ",".join(urls)
                    ready(f"{where} model={models.name}")
                    log.info("listening on %s", where)
                    await stopping.wait()
                    await drain(scheduler, settings.shutdown_grace_s, remotes)
                    front.cancel_scope.cancel()
            finally:
                host.close()
            daemon.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # a model that cannot load: its own clear error
        raise _sole_error(group) from None
    finally:
        for sock in http_sockets:  # those hypercorn never took (a load that failed)
            sock.close()
        await grammars.aclose()
        if models is not None:
            await models.close()  # the loaded model's profiles and prompt cache are saved


def _sole_error(group: BaseExceptionGroup) -> BaseException:
    """The one ColibriError a nursery's group carries (what the user must read), else
    the group unchanged (a bug shows its full story)."""
    leaves: list[BaseException] = []

    def collect(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                collect(inner)
        elif not isinstance(exc, trio.Cancelled):
            leaves.append(exc)

    collect(group)
    if len(leaves) == 1 and isinstance(leaves[0], ColibriError):
        return leaves[0]
    return group
