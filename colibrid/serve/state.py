"""The daemon's answers to queries (STATUS, MODEL, TELEMETRY, PROFILE): every stateful
part's `statistics()` rendered as plain JSON-able dicts, which `colibri ps` prints.

Tier figures come from the expert store's own `statistics()` when it has one (the tiered
store); the fully resident store is reported as everything in RAM, hit rate 100%.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import time
from dataclasses import dataclass, replace
from typing import Any

import trio

from colibrid import __version__
from colibrid.errors import NoModel
from colibrid.installed import remote_spec
from colibrid.remote.spec import RemoteSpec
from colibrid.serve.grammars import GrammarService
from colibrid.serve.host import EngineHost
from colibrid.serve.models import ModelSlot
from colibrid.serve.prepare import Preparer
from colibrid.serve.profiles import ProfileBook, ProfileError
from colibrid.serve.remote_body import remote_call
from colibrid.serve.remote_runs import RemoteRunner
from colibrid.serve.requests import GenerateRequest
from colibrid.serve.scheduler import Handle, Scheduler

GB = 1024**3
log = logging.getLogger("colibrid.state")
# How long `profile use` waits for its pins before replying anyway: pinning reads the
# hot experts from disk, seconds for a big profile; past this it goes on in the background.
REPIN_WAIT_S = 10.0


@dataclass
class DaemonState:
    """What the front ends read and ask of the daemon: the engine host, the scheduler and
    the model slot (which model is loaded, if any)."""

    host: EngineHost
    scheduler: Scheduler
    models: ModelSlot
    started: float = dataclasses.field(default_factory=time.time)
    http_urls: list[str] = dataclasses.field(default_factory=list)  # where the HTTP API is
    grammars: GrammarService = dataclasses.field(default_factory=GrammarService)
    # remote models' requests (serve.remote_runs); None: a daemon that serves none
    remotes: RemoteRunner | None = None
    preparer: Preparer = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.preparer = Preparer(self.grammars)

    # ---- where a request runs: the engine, or a remote model's endpoint ------------------
    def remote(self, model: str | None) -> RemoteSpec | None:
        """The remote model `model` names (`colibri pull URL`), or None: a local one (a
        name that is neither is the model slot's to refuse)."""
        if not model or self.remotes is None or model == self.models.name:
            return None
        return remote_spec(self.models.paths, model)

    async def ready(self, model: str | None) -> str:
        """Make `model` ready to answer (a local one loaded: ModelSlot.ensure; a remote
        one needs nothing, and leaves the local one as it is); its name."""
        if self.remote(model) is not None:
            assert model is not None
            return model
        return (await self.models.ensure(model)).name

    async def prepare(self, request: GenerateRequest, model: str | None = None) -> GenerateRequest:
        """`request` ready to submit: for a remote model, checked that it can be sent
        (serve.remote_body); else tokenised and its grammar compiled for the model loaded
        now (on the trio side: serve.prepare)."""
        spec = self.remote(model)
        if spec is not None:
            remote_call(request, spec)  # what cannot be forwarded is refused now, by name
            return replace(request, remote=spec)
        return await self.preparer.prepare(request, self.models.current)

    def submit_nowait(
        self, request: GenerateRequest, *, same_prompt_as: Handle | None = None
    ) -> Handle:
        """Queue `request` where it runs (ServeError: BUSY, SHUTTING_DOWN); the caller
        then enters `handle.track()`. A remote model's choices are separate requests."""
        if request.remote is not None:
            assert self.remotes is not None
            return self.remotes.submit_nowait(request)
        return self.scheduler.submit_nowait(request, same_prompt_as=same_prompt_as)

    # ---- the loaded model (None while none is) ------------------------------------------
    @property
    def model_name(self) -> str | None:
        return self.models.name

    @property
    def engine(self) -> Any:
        return self.models.current.engine if self.models.current else None

    @property
    def profiles(self) -> ProfileBook:
        if self.models.current is None:
            raise NoModel("no model is loaded (`colibri run NAME` or a request loads one)")
        return self.models.current.book

    @property
    def version(self) -> str:
        """The daemon's version (HTTP's /api/version)."""
        return __version__

    def hello(self) -> list[str]:
        return ["1", f"colibrid/{__version__}", f"model={self.model_name or '-'}"]

    def tiers(self) -> dict[str, Any]:
        """Where the experts are, from the snapshot the engine thread last published."""
        view = self.host.store_view
        if view is None:
            empty = {"experts": 0, "gb": 0.0}
            return {"vram": empty, "ram": dict(empty), "disk": dict(empty), "hit_rate": None}
        snap = view.stats
        size, total, ram = snap.expert_bytes, snap.total_experts, snap.resident_experts
        vram = view.vram
        return {
            "vram": {"experts": 0, "gb": 0.0}
            if vram is None
            else {
                "experts": vram.expert_weights // 3,  # gate, up and down of each
                "gb": vram.expert_bytes / GB,
                "weights_gb": vram.bytes / GB,
                "budget_gb": None if vram.budget is None else vram.budget / GB,
                "device": vram.device,
                "hits": vram.hits,
                "copies": vram.copies,
                "copied_gb": vram.copied_bytes / GB,
                "passed": vram.passed,
                "host_experts": vram.host_experts,
                "host_rule": vram.host_rule,
                "hit_rate": vram.hit_rate,
            },
            "ram": {
                "experts": ram,
                "gb": ram * size / GB,
                "pinned": snap.pinned,
                "pinned_gb": snap.pinned * size / GB,
                "pin_capacity": snap.pin_capacity,
                "pin_mode": snap.pin_mode,
                "pins": snap.pin_note,
            },
            "disk": {"experts": total - ram, "gb": (total - ram) * size / GB},
            "hit_rate": snap.hit_rate if snap.lookups else None,
            "store": dataclasses.asdict(snap),
        }

    def pinned(self) -> frozenset[tuple[int, int]]:
        view = self.host.store_view
        return view.pinned if view is not None else frozenset()

    def status(self) -> dict[str, Any]:
        host, sched = self.host.statistics(), self.scheduler.statistics()
        tiers = self.tiers()
        return {
            "pid": os.getpid(),
            "version": __version__,
            "http": list(self.http_urls),
            "model": self.model_name,
            "model_dir": str(self.models.current.path) if self.models.current else None,
            "loading": self.models.loading,
            "backend": self.models.current.engine.backend if self.models.current else None,
            "kernel_family": self.models.current.engine.family.value
            if self.models.current
            else None,
            # the loaded container's precision plan (store/precision_plan.py): its id and
            # what it holds, e.g. {"id": "3fa2c1d90b7e", "uniform": true, ...}
            "plan": self.models.current.engine.info.plan.as_json() if self.models.current else None,
            "keep_alive_s": self.models.keep_alive_s,
            "unload_in_s": self.models.unload_in(),
            "uptime_s": round(time.time() - self.started, 1),
            "profile": self.models.current.book.active if self.models.current else None,
            "preparing": self.preparer.preparing,
            "queued": sched.queued,
            "running": sched.running,
            "max_queue": sched.max_queue,
            "last_tok_s": round(host.last_tok_s, 2),
            "batch_rows": host.last_batch_rows,
            "shared_passes": host.shared_passes,
            "speculate": self.host.speculate.mode,
            "speculation": host.speculation,
            "roofline": self.roofline(host.roofline),
            "requests_done": host.requests_done,
            "conversations": host.conversations,
            "rss_gb": round(rss_gb(), 3),
            "tiers": tiers,
            "hit_rate": tiers.get("hit_rate"),
            "pinned": sorted(self.pinned()),
            "stopping": self.scheduler.closing,
            # remote models used since the start: their URL (never a key) and requests
            "remote": {} if self.remotes is None else self.remotes.statistics(),
        }

    def roofline(self, last: dict[str, float | str] | None) -> dict[str, Any]:
        """The ceilings measured for the loaded model (null before the first probe) and
        the last finished request's shares of them (serve.roofline; null before one)."""
        ceilings = self.host.ceilings
        return {
            "ceilings": None if ceilings is None else ceilings.as_json(),
            "last": None
            if last is None
            else {k: v if isinstance(v, str) else float(f"{v:.4g}") for k, v in last.items()},
        }

    def model_info(self) -> dict[str, Any]:
        loaded = self.models.current
        if loaded is None:
            raise NoModel("no model is loaded (`colibri run NAME` or a request loads one)")
        engine, layout = loaded.engine, loaded.engine.experts.layout
        return {
            "name": loaded.name,
            "dir": str(loaded.path),
            "model_type": engine.info.model_type,
            "layers": engine.info.n_layers,
            "moe_layers": list(layout.moe_layers),
            "experts": layout.n_experts,
            "hidden": layout.hidden,
            "expert_ffn": layout.ffn,
            "max_context": engine.max_context,
            "vocab_size": engine.vocab_size,
            "load_s": round(engine.info.load_s, 3),
            "plan": engine.info.plan.as_json(),
        }

    def telemetry(self) -> dict[str, Any]:
        tiers = self.tiers()
        return {
            "tiers": tiers,
            "hit_rate": tiers.get("hit_rate"),
            "rss_gb": round(rss_gb(), 3),
            "pinned": len(self.pinned()),
        }

    async def profile(self, action: str, name: str | None, create: bool = False) -> tuple[str, Any]:
        """Returns (reply kind, body): PROFILES json, PROFILE json, or OK words.

        SAVE and FLUSH that cannot write raise PersistError (code IO, naming the file):
        the client gets `ERROR - IO cannot write ...`, the counts stay in memory and the
        daemon goes on serving."""
        book = self.profiles
        if action == "LIST":
            return "PROFILES", {
                "model": self.model_name,
                "active": book.active,
                "profiles": book.listing(),
            }
        if action == "SHOW":
            assert name is not None
            if name not in book.names():
                raise ProfileError(
                    f"no profile {name!r} for {self.model_name} (it has: "
                    f"{', '.join(book.names())}); `colibri profile warm {name}` learns a "
                    f"built-in domain, and requests with `--profile {name}` count into it"
                )
            counts = book.counts(name)
            layers = list(self.engine.experts.layers)
            return "PROFILE", {
                "name": name,
                "model": self.model_name,
                "layers": layers,
                "counts": [counts[layer].tolist() for layer in layers],
            }
        if action == "USE":
            assert name is not None
            try:
                await trio.to_thread.run_sync(lambda: book.use(name, create=create))
            except BaseException:  # chosen even when remembering it failed (a full disk)
                if book.active == name:
                    self.host.call_soon(self._repin)  # pin from it all the same
                raise
            # the reply once the pins are in, so `colibri ps` right after shows them
            with trio.move_on_after(REPIN_WAIT_S):
                try:
                    await self.host.call(self._repin)
                except Exception:  # placement only: the switch itself stands
                    log.exception("re-pinning from profile %s failed", name)
            return "OK", ["PROFILE", "USE", name]
        if action == "FLUSH":
            await trio.to_thread.run_sync(book.save_all)
            return "OK", ["PROFILE", "FLUSH"]
        path = await trio.to_thread.run_sync(lambda: book.save(name, source=book.active))
        return "OK", ["PROFILE", "SAVE", name or book.active, str(path)]

    def _repin(self) -> None:
        """Engine thread, between two steps: pin from the active profile (placement
        only, no token changes)."""
        loaded = self.models.current  # the model loaded by then, if any
        if loaded is not None:
            loaded.engine.apply_profile(loaded.book.counts(loaded.book.active))


def rss_gb() -> float:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GB
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
