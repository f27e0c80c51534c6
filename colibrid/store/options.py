"""Store options (the knobs of `colibrid generate`, `colibrid start` and config.toml),
the factory that turns them into an expert store, and the planner a tiered store is
opened with (:class:`TierPlanner`: the budget from the headers, the KV size and these
knobs, which plan every slot; :mod:`colibrid.store.memory_plan`).

Default (``mode="auto"``): when the routed experts plus the dense part fit in half the
RAM budget, keep them resident as zero-copy mmap views (no I/O, no copies: the page
cache is the cache); otherwise stream them through the tiered store with an automatic
budget. Any explicit placement knob (``--ram-gb``, ``--cache``, ``--pin``, ``--pilot``,
``--io-threads``, ``--direct``, ``--profile``) selects the tiered store, so the knob is
never silently ignored. FP8/F16 expert checkpoints are converted on load and stay
resident (a warning says so when they do not fit).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from colibrid.policy import DEFAULT_POLICY
from colibrid.store import budget as budgets
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.experts import ExpertLayout, expert_tensor_names
from colibrid.store.extents import NotStreamable
from colibrid.store.integrity import Digests
from colibrid.store.memory_plan import StorePlan
from colibrid.store.pilot_memory import PilotMemory
from colibrid.store.pilot_switch import PilotSwitch
from colibrid.store.pins import PIN_MODES, PinBudget
from colibrid.store.protocol import ExpertStore
from colibrid.store.resident import ResidentExpertStore
from colibrid.store.tiered import TieredStore
from colibrid.store.usage import UsageProfile
from colibrid.store.weight_checks import check_covered, load_digests, verify_mapped

log = logging.getLogger("colibri.store")
PILOT_MODES = ("on", "off", "auto")
# Slots PILOT may read into ahead of the router: top-8 plus its runners-up on GLM-5
# (engine/pilot.py EXTRA_GUESSES); a guess beyond them waits for a slot.
PILOT_SLOTS = 12
# Slots a layer's demand misses stream through (iter_ready reuses each as soon as its
# expert is computed): twice GLM-5's top-8, so a decode step never waits for one and a
# prefill's larger union streams through them. Every slot beyond this is cache.
WORK_SLOTS = 16


@dataclass(frozen=True)
class StoreOptions:
    mode: str = "auto"  # auto | resident | tiered
    ram_gb: float | None = None
    cache: int | None = None  # experts per layer; overrides the budget
    pin: str = "auto"
    pilot: str = "auto"
    io_threads: int = 4  # 0 = reads inline on the engine thread
    direct: bool = True
    profile: str | None = None  # .coli_usage path (read, and written after each request)
    policy: str = DEFAULT_POLICY
    memwatch: bool = True
    memory_floor_gb: float | None = None  # MEMWATCH keeps this much available (None: derived)
    save_profile: bool = True
    pin_at_start: bool = True  # pin from `profile` now (the daemon's profile book pins later)
    verify: bool = True  # hold weight bytes to the manifest's digests (store/weight_checks.py)
    # the profiles folder ($COLIBRI_HOME/profiles): PILOT remembers what it measured, per
    # model and plan, in MODEL/pilot.json there (store/pilot_memory.py); None: it forgets
    profiles_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "resident", "tiered"):
            raise ValueError(f"store mode {self.mode!r} must be auto, resident or tiered")
        if self.pin not in PIN_MODES:
            raise ValueError(f"--pin must be one of {PIN_MODES}, got {self.pin!r}")
        if self.pilot not in PILOT_MODES:
            raise ValueError(f"--pilot must be one of {PILOT_MODES}, got {self.pilot!r}")
        if self.cache is not None and self.cache < 0:
            raise ValueError(f"--cache must be >= 0, got {self.cache}")
        if self.io_threads < 0:
            raise ValueError(f"--io-threads must be >= 0, got {self.io_threads}")
        if self.memory_floor_gb is not None and self.memory_floor_gb < 0:
            raise ValueError(f"memory_floor_gb must be >= 0, got {self.memory_floor_gb}")


@dataclass(frozen=True)
class StoreSizing:
    """What the budget plan needs to know of a tiered store before it allocates."""

    total: int  # the RAM budget in bytes
    source: str  # where the budget came from ("auto", "--ram-gb")
    dense: int  # bytes of everything that is not a routed expert
    model_type: str
    model_key: str = ""  # the model's folder and size: what PILOT's memory is kept under
    model_name: str = ""  # the folder's name: its profiles' folder


@dataclass(frozen=True)
class TierPlanner:
    """The budget a tiered store is opened with, the KV cache's size and the knobs that
    shape its plan (a :class:`~colibrid.store.memory_plan.MemoryPlanner`)."""

    sizing: StoreSizing
    opts: StoreOptions
    kv_bytes: int

    def plan(
        self,
        *,
        layers: tuple[int, ...],
        n_layers: int,
        n_experts: int,
        slot_bytes: int,
    ) -> StorePlan:
        """Every slot from one budget, with the pins it leaves room for, and the parts
        that follow from it (the usage profile, PILOT's switch, MEMWATCH's floor)."""
        sizing, opts = self.sizing, self.opts
        # Co-occurrences only where they are saved (the `.cooc.npz` sidecar `convert --order`
        # reads): the daemon's profile book keeps counts, so its store does not pay for them.
        save_to = opts.profile if opts.save_profile else None
        usage = UsageProfile(
            max(layers) + 1, n_experts, sizing.model_type, layers, cooc=save_to is not None
        )
        if opts.profile:
            usage.merge_file(Path(opts.profile))
        plan = partial(
            budgets.plan,
            total=sizing.total,
            source=sizing.source,
            dense=sizing.dense,
            kv=self.kv_bytes,
            slot_bytes=slot_bytes,
            n_layers=n_layers,
            n_experts=n_experts,
            work_slots=min(n_experts, WORK_SLOTS),
            pilot_slots=0 if opts.pilot == "off" else min(n_experts, PILOT_SLOTS),
            cache=opts.cache,
        )
        base = plan()
        room = base.total - base.dense - base.kv - base.reserve - base.work
        pin_first = opts.pin == "all" and opts.cache is None  # --pin all: pins before the cache
        pin_budget = PinBudget.plan(
            opts.pin,
            expert_room=room,
            cache_room=0 if pin_first else base.cache_bytes,
            slot_bytes=slot_bytes,
            n_experts_total=n_experts * len(layers),
        )
        if pin_budget.capacity:
            base = plan(pins=pin_budget.capacity * slot_bytes)
        streams = base.cache_per_layer < n_experts
        floor = opts.memory_floor_gb
        return StorePlan(
            budget=base,
            pin_budget=pin_budget,
            usage=usage,
            save_usage_to=save_to,
            pin_at_start=opts.pin_at_start,
            pilot_switch=self.pilot_switch(base) if streams else None,
            memwatch=opts.memwatch,  # whenever experts stream, `--cache` included (the ceiling)
            memory_floor=None if floor is None else int(floor * budgets.GiB),
        )

    def pilot_switch(self, base: budgets.BudgetPlan) -> PilotSwitch | None:
        """`--pilot auto`: PILOT measures whether it pays (starting from what earlier runs
        of this model and budget measured, when remembered); `on` or `off`: the run
        measures its state for the memory and never switches; None when there is nothing
        to measure."""
        opts = self.opts
        memory = None
        if opts.profiles_dir is not None:  # the user's knobs, not the budget they gave today
            key = (
                f"{self.sizing.model_key}|ram={opts.ram_gb}|cache={opts.cache}|pin={opts.pin}|"
                f"io={opts.io_threads}|direct={opts.direct}"
            )
            memory = PilotMemory(opts.profiles_dir / self.sizing.model_name / "pilot.json", key)
        if opts.pilot == "auto" and base.pilot_slots:
            return PilotSwitch(memory)
        if memory is None or opts.pilot == "auto":
            return None
        return PilotSwitch(memory, fixed=opts.pilot == "on")


def split_bytes(
    checkpoint: Checkpoint, expert_names: set[str], idle_prefixes: tuple[str, ...] = ()
) -> tuple[int, int]:
    """(dense, experts): bytes of everything resident that is not a routed expert, and
    of the routed experts' tensors. Tensors under ``idle_prefixes`` (a layer loaded but
    never run, e.g. MTP) are mapped, never read, so they cost no RAM and are not counted."""
    dense = experts = 0
    for info in checkpoint.infos():
        if info.name in expert_names:
            experts += info.nbytes
        elif not info.name.startswith(idle_prefixes):
            dense += info.nbytes
    return dense, experts


def open_store(
    checkpoint: Checkpoint,
    layout: ExpertLayout,
    opts: StoreOptions,
    model_type: str,
    *,
    kv_bytes: int = 0,
    idle_prefixes: tuple[str, ...] = (),
) -> ExpertStore:
    """The expert store for ``opts``, its memory planned whole (``kv_bytes``: what the KV
    cache takes of the budget at the full context).
    ``idle_prefixes``: tensors loaded but never run (kept out of the budget, unchecked).
    With ``opts.verify`` the weights the model reads are held to the container's digests
    by the daemon's rule (:mod:`colibrid.store.weight_checks`): what is mapped is checked
    here, before the store is built; streamed experts as they are read."""
    digests = load_digests(checkpoint) if opts.verify else None
    checks = None if digests is None else _check_dense(checkpoint, layout, digests, idle_prefixes)
    total, source = budgets.resolve_total(opts.ram_gb)
    if opts.mode == "resident" or not layout.moe_layers:  # no routed experts: none to stream
        return _resident(checkpoint, layout, checks)
    # From the headers alone (the tiered store's planned payload is these same bytes),
    # before planning ~10^4 extents: auto keeps everything resident in half the budget.
    dense, experts = split_bytes(checkpoint, expert_tensor_names(layout), idle_prefixes)
    if opts.mode == "auto" and dense + experts <= total // 2:
        return _resident(checkpoint, layout, checks)
    model_key = f"{checkpoint.dir.resolve()}|{sum(f.path.stat().st_size for f in checkpoint.files)}"
    sizing = StoreSizing(total, source, dense, model_type, model_key, checkpoint.dir.name)
    budgets.check_dense_fits(total, dense, source)  # before a slot is planned
    try:
        store = TieredStore(
            checkpoint,
            layout,
            direct=opts.direct,
            io_threads=opts.io_threads,
            policy=opts.policy,
            digests=None if checks is None else checks.digests,
            planner=TierPlanner(sizing, opts, kv_bytes),
        )
    except NotStreamable as exc:
        log.warning("colibri: experts stay resident (%s)", exc)
        return _resident(checkpoint, layout, checks)
    if checks is not None:  # every streamed expert is checked as it is read
        try:
            check_covered(checkpoint, checks.digests, checks.experts)
        except BaseException:
            store.close()
            raise
    return store


@dataclass(frozen=True)
class _Checks:
    """The container's digests, and the routed experts' tensors they must cover (checked
    now when mapped, as they are read when streamed)."""

    digests: Digests
    experts: set[str]


def _check_dense(
    checkpoint: Checkpoint, layout: ExpertLayout, digests: Digests, idle: tuple[str, ...]
) -> _Checks:
    """Check every dense tensor the model reads now: it is mapped whatever the store."""
    names = checkpoint.names()
    routed = expert_tensor_names(layout).intersection(names)
    mapped = [n for n in names if n not in routed and not n.startswith(idle)]
    verify_mapped(checkpoint, digests, mapped, "dense weights")
    return _Checks(digests, routed)


def _resident(
    checkpoint: Checkpoint, layout: ExpertLayout, checks: _Checks | None
) -> ResidentExpertStore:
    """Every expert mapped, and (with digests) checked now."""
    store = ResidentExpertStore(checkpoint, layout)
    if checks is not None:
        try:
            verify_mapped(checkpoint, checks.digests, sorted(checks.experts), "resident experts")
        except BaseException:
            store.close()
            raise
    return store
