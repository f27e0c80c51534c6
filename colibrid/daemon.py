"""colibrid's nursery tree: read the indentation of `serve` to see the process.

::

    serve
    ├── load the model (in a thread, so signals stay responsive)
    └── daemon nursery
        ├── signal watcher (SIGTERM/SIGINT -> stopping)
        ├── engine host (owns the one engine thread)
        ├── scheduler (admission, fairness)
        ├── profile saver (periodic atomic writes; final flush after the nursery)
        └── front nursery
            ├── socket server: serve_listeners -> one task per connection
            └── http (optional): hypercorn.trio.serve(ASGI app) -> one task per connection

Readiness (`ready`) is reported only after the socket is bound. Shutdown: refuse new
requests, let running ones finish within `shutdown_grace_s`, cancel the rest (freed within
one token), wait until their last lines are written, then cancel the rest of the tree.

A disk that fills (or fails) never stops the daemon: a periodic save that fails is logged
once per distinct error and tried again next period; the final save at shutdown tries the
profiles and the prompt cache each, logs what was not saved, and never raises.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from colibrid.config import Settings, speculation, store_options
from colibrid.errors import ColibriError
from colibrid.http.app import parse_bind, serve_http
from colibrid.paths import Paths, make_state_private, remove_orphan_temps
from colibrid.serve.host import EngineHost
from colibrid.serve.profiles import ProfileBook
from colibrid.serve.scheduler import Scheduler
from colibrid.serve.session import serve_connection
from colibrid.serve.socket_server import serve_socket
from colibrid.serve.state import DaemonState

if TYPE_CHECKING:
    from colibrid.engine.engine import Engine

log = logging.getLogger("colibrid")


def load_model(model_dir: Path, settings: Settings) -> tuple[object, object]:
    """The engine and its text codec (None when the checkpoint has no tokenizer)."""
    from colibrid.engine.engine import Engine
    from colibrid.engine.tokenizer import TextCodec

    engine = Engine.load(
        model_dir,
        max_context=settings.max_context,
        store=store_options(settings),
        mtp=settings.speculate in ("mtp", "auto"),
    )
    has_tokenizer = (model_dir / "tokenizer.json").is_file()
    codec = TextCodec.load(model_dir, max_context=engine.max_context) if has_tokenizer else None
    return engine, codec


def make_profiles(paths: Paths, settings: Settings, engine: Engine, name: str) -> ProfileBook:
    """The model's profile book; the active profile's counts choose the pins."""
    store = engine.experts
    return ProfileBook(
        paths.profiles / name, tuple(store.counts.shape), engine.info.model_type, settings.profile
    )


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


def _save_prompt_cache(host: EngineHost, directory: Path) -> int:
    """A prompt cache that cannot be written (a full disk) is logged; the stop goes on."""
    try:
        return host.save_prompt_cache(directory)
    except (OSError, ColibriError) as exc:
        log.warning("prompt cache not saved to %s: %s", directory, _reason(exc))
    except Exception:  # the final save must not turn a clean stop into a crash
        log.exception("prompt cache not saved to %s", directory)
    return 0


def _save_profiles_finally(book: ProfileBook) -> bool:
    """The last save of the profiles; False (logged, naming the files) when it failed."""
    try:
        book.save_all()
        return True
    except (OSError, ColibriError) as exc:
        log.warning("profiles not saved: %s", _reason(exc))
    except Exception:
        log.exception("profiles not saved to %s", book.directory)
    return False


async def watch_signals(stopping: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s: stopping", signal.Signals(signum).name)
            stopping.set()


async def save_profiles(book: ProfileBook, every_s: float) -> None:
    """Save every `every_s`; a failure is logged when it first happens or changes (not
    every period while the disk stays full) and when saving works again."""
    failing: str | None = None
    while True:
        await trio.sleep(every_s)
        try:
            await trio.to_thread.run_sync(book.save_all)
        except (OSError, ColibriError) as exc:
            if _reason(exc) != failing:
                failing = _reason(exc)
                log.warning("profiles not saved (trying again every %g s): %s", every_s, failing)
            continue
        if failing is not None:
            log.info("profiles saved again")
            failing = None


async def drain(scheduler: Scheduler, grace_s: float) -> None:
    """In-flight requests end (within the grace) or are cancelled; queued ones fail."""
    scheduler.close_nowait()
    with trio.move_on_after(grace_s):
        await scheduler.wait_idle()
    scheduler.cancel_running()
    with trio.move_on_after(5.0):  # a client that stopped reading must not hold us
        await scheduler.wait_idle()


async def serve(
    settings: Settings, paths: Paths, model_dir: Path, ready: Callable[[str], None]
) -> None:
    name = model_dir.name
    if settings.http:
        parse_bind(settings.http, settings.http_api_key)  # refuse before loading the model
    tidy_home(paths)
    log.info("loading %s", model_dir)
    engine, codec = await trio.to_thread.run_sync(load_model, model_dir, settings)
    book = make_profiles(paths, settings, engine, name)
    # Pin from the active profile before serving (no engine thread exists yet, so this
    # thread may touch the store): `ps` right after start already shows the pins.
    store = engine.experts
    await trio.to_thread.run_sync(lambda: store.apply_pins(book.counts(book.active)))
    log.info("pins from profile %r: %s", book.active, store.pins.note)
    host = EngineHost(
        engine,
        codec,
        max_conversations=settings.max_conversations,
        prompt_cache=settings.prompt_cache,
        layer_delay_s=settings.debug_layer_delay_s,
        fail_prompt=settings.debug_fail_prompt,
        fail_after=settings.debug_fail_after,
        usage=book,
        speculate=speculation(settings),
    )
    kv_dir = paths.kv / name
    restored = await trio.to_thread.run_sync(host.restore_prompt_cache, kv_dir)
    if restored:
        log.info("prompt cache: %d kept session(s) restored from %s", restored, kv_dir)
    stopping = trio.Event()
    try:
        async with trio.open_nursery() as daemon:
            daemon.start_soon(watch_signals, stopping)
            await daemon.start(host.serve)
            scheduler = Scheduler(
                host, max_queue=settings.max_queue, max_active=settings.max_active
            )
            await daemon.start(scheduler.serve)
            state = DaemonState(name, model_dir, engine, host, scheduler, book)
            daemon.start_soon(save_profiles, book, settings.profile_save_s)
            try:  # a front that fails to start must still end the engine thread
                async with trio.open_nursery() as front:
                    await front.start(
                        serve_socket, paths.socket, lambda stream: serve_connection(stream, state)
                    )
                    where = str(paths.socket)
                    if settings.http:  # the OpenAI/Anthropic API: same scheduler and state
                        urls = await front.start(serve_http, state, settings)
                        state.http_urls = list(urls)
                        where += " http=" + ",".join(urls)
                    ready(f"{where} model={name}")
                    log.info("listening on %s", where)
                    await stopping.wait()
                    await drain(scheduler, settings.shutdown_grace_s)
                    front.cancel_scope.cancel()
            finally:
                host.close()
            daemon.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):  # each attempted; neither raises
            saved = await trio.to_thread.run_sync(_save_profiles_finally, book)
            kept = await trio.to_thread.run_sync(_save_prompt_cache, host, kv_dir)
        log.info(
            "stopped; %s; prompt cache: %d session(s) kept",
            "profiles saved" if saved else "profiles NOT saved (see above)",
            kept,
        )
