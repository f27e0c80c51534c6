"""The model the daemon serves, and its lifecycle.

One model is loaded at a time (its dense weights and expert cache are most of the
machine's memory). The daemon loads its default at start; a request that names another
installed model (`model=` over SERVE, `model` over HTTP) has it loaded in place of the
first when the daemon is idle, or is told MODEL_BUSY while requests still run; `colibri
stop` unloads it (the daemon stays, and the next request loads a model again); and a
model left idle for its `keep_alive` is unloaded (config.toml `keep_alive`, or the
`keep_alive` of the last request: 0 unloads right after it, a negative value never).

Loading and unloading run on the engine thread (`EngineHost.call`), between two steps of
nothing: the thread that owns an engine is the one that builds and closes it. Unloading
saves what the model leaves behind first: its prompt cache (`kv/<model>/`) and its usage
profiles, as a stop does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from colibri_protocol.messages import seconds

from colibrid.config import Settings, resolve_model, store_options
from colibrid.errors import (
    ColibriError,
    ConfigError,
    ModelBusy,
    ModelNotFound,
    NoModel,
    PersistError,
)
from colibrid.paths import Paths
from colibrid.serve.profiles import ProfileBook

if TYPE_CHECKING:  # the engine loads numpy and the kernels: imported when a model loads
    from colibrid.engine.engine import Engine
    from colibrid.engine.tokenizer import TextCodec
    from colibrid.serve.host import Job

log = logging.getLogger("colibrid.models")

WATCH_S = 0.25  # how often the keep_alive deadline is checked
LOAD_GRACE_S = 10.0  # a model just loaded stays at least this long for its first request


@dataclass
class Loaded:
    """A model being served: what the daemon built for it."""

    name: str
    path: Path
    engine: Engine
    codec: TextCodec | None
    book: ProfileBook
    kv_dir: Path
    loaded_at: float = field(default_factory=time.time)


def parse_keep_alive(value: object) -> float:
    """Seconds from a number or a duration ("30s", "5m", "1h"); negative: forever."""
    wrong = ConfigError(f"keep_alive must be seconds or a duration like 5m, not {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise wrong
    try:
        result = seconds(str(value))
    except (ValueError, IndexError):
        raise wrong from None
    return result


def load_model(
    model_dir: Path, settings: Settings, profiles: Path | None = None
) -> tuple[Engine, TextCodec | None]:
    """The engine and its text codec (None when the checkpoint has no tokenizer);
    ``profiles``: the profiles folder (PILOT's memory of this model lives there)."""
    from colibrid.backends.base import KernelFamily
    from colibrid.engine.backend import make_ops
    from colibrid.engine.engine import Engine
    from colibrid.engine.tokenizer import TextCodec, has_tokenizer

    family = KernelFamily(settings.kernel_family)
    engine = Engine.load(
        model_dir,
        family=family,
        ops=make_ops(settings.backend, family, vram_gb=settings.vram_gb),
        max_context=settings.max_context,
        store=store_options(settings, profiles),
        mtp=settings.speculate in ("mtp", "auto"),
    )
    text = has_tokenizer(model_dir)  # one that is there but unreadable is refused, named
    codec = TextCodec.load(model_dir, max_context=engine.max_context) if text else None
    return engine, codec


class ModelSlot:
    """The one model slot: who is loaded, loading it, swapping it, letting it go."""

    def __init__(self, settings: Settings, paths: Paths, host: Any, scheduler: Any) -> None:
        self.settings = settings
        self.paths = paths
        self.host = host
        self.scheduler = scheduler
        self.current: Loaded | None = None
        self.loading: str | None = None
        self._loaded = trio.Event()
        self._lock = trio.Lock()
        self.configured_keep_alive_s = parse_keep_alive(settings.keep_alive)
        self.keep_alive_s = self.configured_keep_alive_s  # the last request's, else configured
        self.unload_at: float | None = None  # time.monotonic() deadline, when idle
        scheduler.on_finished = self.request_done

    # ---- what is served -----------------------------------------------------------------
    @property
    def name(self) -> str | None:
        return self.current.name if self.current else None

    def resolve(self, name: str | None) -> Path:
        """An installed model's folder (or a folder given as a path); the default one for
        None (config.toml `default_model`, else the built-in demo)."""
        try:
            return resolve_model(self.paths, name or self.settings.default_model)
        except ConfigError as exc:
            raise ModelNotFound(f"{exc} (`colibri list` shows what is installed)") from None

    def idle(self) -> bool:
        st = self.scheduler.statistics()
        return st.running == 0 and st.queued == 0

    async def ensure(self, name: str | None) -> Loaded:
        """The loaded model a request for `name` runs on (None: whatever is loaded, else
        the default), loading it first when the daemon is idle."""
        while True:
            if self.current is not None and name in (None, self.current.name):
                return self.current
            path = self.resolve(name)
            if self.current is not None and self.current.path == path:
                return self.current
            if self.loading is not None:
                if self.loading != path.name:
                    raise ModelBusy(f"the daemon is loading {self.loading}; try again when it has")
                await self._loaded.wait()
                continue
            if self.current is not None and not self.idle():
                raise ModelBusy(
                    f"the daemon serves {self.current.name} and requests are running; "
                    f"{path.name} can be loaded when it is idle"
                )
            await self.switch(path)

    async def switch(self, path: Path) -> None:
        async with self._lock:
            if self.current is not None and self.current.path == path:
                return
            if self.current is not None:
                if not self.idle():  # a request got in while this waited for the lock
                    raise ModelBusy(
                        f"the daemon serves {self.current.name} and requests are running; "
                        f"{path.name} can be loaded when it is idle"
                    )
                await self._unload(f"{path.name} was asked for")
            await self._load(path)

    async def unload(self, why: str) -> str:
        """Unload the model now (the daemon must be idle); its name."""
        if self.current is None:
            raise NoModel("no model is loaded")
        if not self.idle():
            raise ModelBusy(f"{self.current.name} is answering requests; it unloads when idle")
        async with self._lock:
            name = self.current.name if self.current else "-"
            if self.current is not None:
                await self._unload(why)
            return name

    # ---- keep_alive ---------------------------------------------------------------------
    def request_done(self, job: Job) -> None:
        """A request ended: its keep_alive, or the configured one when it names none (as
        Ollama: one request's keep_alive does not outlive the next request), rules now."""
        self.hold(job.request.keep_alive)

    def hold(self, keep: float | None) -> None:
        """`keep` (seconds; None: the configured keep_alive) rules from now: an idle model
        is unloaded that long after. A request's end sets it, and so does Ollama's load
        request (a body with nothing to answer, only a model and its keep_alive)."""
        self.keep_alive_s = self.configured_keep_alive_s if keep is None else keep
        if self.idle():
            self.unload_at = (
                time.monotonic() + self.keep_alive_s if self.keep_alive_s >= 0 else None
            )

    def unload_in(self) -> float | None:
        """Seconds until an idle model is unloaded; None: it stays."""
        if self.current is None or self.unload_at is None or not self.idle():
            return None
        return max(0.0, self.unload_at - time.monotonic())

    async def watch(self) -> None:
        """Unload the model once it has been idle for its keep_alive (never returns)."""
        while True:
            await trio.sleep(WATCH_S)
            if self.current is None or self.loading is not None or not self.idle():
                continue
            if self.unload_at is not None and time.monotonic() >= self.unload_at:
                self.unload_at = None
                try:
                    await self.unload(f"idle for its keep_alive of {self.keep_alive_s:g} s")
                except ColibriError:
                    continue  # a request came in meanwhile

    # ---- load and unload (on the engine thread) -----------------------------------------
    async def _load(self, path: Path) -> None:
        self.loading = path.name
        self._loaded = trio.Event()
        started = time.perf_counter()
        try:
            self.current = await self.host.call(lambda: self._load_here(path))
        finally:
            self.loading = None
            self._loaded.set()
        # Its keep_alive runs from now (a model loaded for no request does not stay
        # forever), with a grace for the request that asked for it to arrive.
        keep = self.keep_alive_s
        self.unload_at = time.monotonic() + max(keep, LOAD_GRACE_S) if keep >= 0 else None
        log.info(
            "loaded %s from %s on the %s backend (%s kernel family) in %.1f s",
            path.name,
            path,
            self.current.engine.backend,
            self.current.engine.family.value,
            time.perf_counter() - started,
        )

    def _load_here(self, path: Path) -> Loaded:
        engine, codec = load_model(path, self.settings, self.paths.profiles)
        try:
            book = ProfileBook(
                self.paths.profiles / path.name,
                tuple(engine.experts.counts.shape),
                engine.info.model_type,
                self.settings.profile,
            )
            engine.apply_profile(book.counts(book.active))
            log.info("pins from profile %r: %s", book.active, engine.experts.pins.note)
            self.host.install(engine, codec, book)
            self.host.measure_ceilings()  # before any request can run (serve.roofline)
            kv_dir = self.paths.kv / path.name
            restored = self.host.restore_prompt_cache(kv_dir)
            if restored:
                log.info("prompt cache: %d kept session(s) restored from %s", restored, kv_dir)
        except BaseException:
            self.host.uninstall()
            engine.close()
            raise
        return Loaded(path.name, path, engine, codec, book, kv_dir)

    async def _unload(self, why: str) -> None:
        loaded = self.current
        assert loaded is not None
        kept = await self.host.call(lambda: self._unload_here(loaded))
        self.current = None
        self.unload_at = None
        saved = await trio.to_thread.run_sync(lambda: save_profiles_finally(loaded.book))
        log.info(
            "unloaded %s (%s); %s; prompt cache: %d session(s) kept",
            loaded.name,
            why,
            "profiles saved" if saved else "profiles NOT saved (see above)",
            kept,
        )

    def _unload_here(self, loaded: Loaded) -> int:
        kept = save_prompt_cache(self.host, loaded.kv_dir)
        engine = self.host.uninstall()
        if engine is not None:
            engine.close()
        return kept

    async def close(self) -> None:
        """At the daemon's stop (the engine thread has ended): save what the model leaves."""
        loaded = self.current
        if loaded is None:
            return
        with trio.CancelScope(shield=True):
            saved = await trio.to_thread.run_sync(lambda: save_profiles_finally(loaded.book))
            kept = await trio.to_thread.run_sync(
                lambda: save_prompt_cache(self.host, loaded.kv_dir)
            )
        log.info(
            "stopped; %s; prompt cache: %d session(s) kept",
            "profiles saved" if saved else "profiles NOT saved (see above)",
            kept,
        )


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def save_prompt_cache(host: Any, directory: Path) -> int:
    """A prompt cache that cannot be written (a full disk) is logged; the unload goes on."""
    try:
        return host.save_prompt_cache(directory)
    except (OSError, ColibriError) as exc:
        log.warning("prompt cache not saved to %s: %s", directory, _reason(exc))
    except Exception:  # the final save must not turn a clean stop into a crash
        log.exception("prompt cache not saved to %s", directory)
    return 0


def save_profiles_finally(book: ProfileBook) -> bool:
    """The last save of a model's profiles; False (logged, naming the files) when it failed."""
    try:
        book.save_all()
        return True
    except (OSError, ColibriError, PersistError) as exc:
        log.warning("profiles not saved: %s", _reason(exc))
    except Exception:
        log.exception("profiles not saved to %s", book.directory)
    return False
