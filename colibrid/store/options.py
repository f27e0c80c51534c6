"""Store options (the knobs of `colibrid generate`, `colibrid start` and config.toml)
and the factory that turns them into an expert store.

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

import numpy as np

from colibrid.policy import DEFAULT_POLICY
from colibrid.store import budget as budgets
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.experts import ExpertLayout, expert_tensor_names
from colibrid.store.extents import NotStreamable
from colibrid.store.integrity import Digests
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
    idle_prefixes: tuple[str, ...] = (),
) -> ExpertStore:
    """The expert store for ``opts``; it still needs :func:`allocate_store`.
    ``idle_prefixes``: tensors loaded but never run (kept out of the budget, unchecked).
    With ``opts.verify`` the weights the model reads are held to the container's digests
    by the daemon's rule (:mod:`colibrid.store.weight_checks`): what is mapped is checked
    here, before the store is built; streamed experts as they are read."""
    digests = load_digests(checkpoint) if opts.verify else None
    experts: set[str] = set()
    if digests is not None:  # the dense part is mapped whatever the store
        names = checkpoint.names()
        experts = expert_tensor_names(layout).intersection(names)
        mapped = [n for n in names if n not in experts and not n.startswith(idle_prefixes)]
        verify_mapped(checkpoint, digests, mapped, "dense weights")
    store = _open(checkpoint, layout, opts, model_type, idle_prefixes, digests)
    if digests is not None:
        try:
            if isinstance(store, TieredStore):  # checked as they are read
                check_covered(checkpoint, digests, experts)
            else:  # every expert is mapped too
                verify_mapped(checkpoint, digests, sorted(experts), "resident experts")
        except BaseException:
            store.close()
            raise
    return store


def _open(
    checkpoint: Checkpoint,
    layout: ExpertLayout,
    opts: StoreOptions,
    model_type: str,
    idle_prefixes: tuple[str, ...],
    digests: Digests | None,
) -> ExpertStore:
    total, source = budgets.resolve_total(opts.ram_gb)
    if opts.mode == "resident" or not layout.moe_layers:  # no routed experts: none to stream
        return ResidentExpertStore(checkpoint, layout)
    # From the headers alone (the tiered store's planned payload is these same bytes),
    # before planning ~10^4 extents: auto keeps everything resident in half the budget.
    dense, experts = split_bytes(checkpoint, expert_tensor_names(layout), idle_prefixes)
    if opts.mode == "auto" and dense + experts <= total // 2:
        return ResidentExpertStore(checkpoint, layout)
    try:
        store = TieredStore(
            checkpoint,
            layout,
            direct=opts.direct,
            io_threads=opts.io_threads,
            policy=opts.policy,
            digests=digests,
        )
    except NotStreamable as exc:
        log.warning("colibri: experts stay resident (%s)", exc)
        return ResidentExpertStore(checkpoint, layout)
    budgets.check_dense_fits(total, dense, source)
    model_key = f"{checkpoint.dir.resolve()}|{sum(f.path.stat().st_size for f in checkpoint.files)}"
    store.sizing = StoreSizing(total, source, dense, model_type, model_key, checkpoint.dir.name)
    return store


def pilot_switch(
    store: TieredStore, opts: StoreOptions, base: budgets.BudgetPlan
) -> PilotSwitch | None:
    """`--pilot auto`: PILOT measures whether it pays (starting from what earlier runs of
    this model and budget measured, when remembered); `on` or `off`: the run measures its
    state for the memory and never switches; None when there is nothing to measure."""
    memory = None
    if opts.profiles_dir is not None:  # the user's knobs, not the budget they gave today
        key = (
            f"{store.sizing.model_key}|ram={opts.ram_gb}|cache={opts.cache}|pin={opts.pin}|"
            f"io={opts.io_threads}|direct={opts.direct}"
        )
        path = opts.profiles_dir / store.sizing.model_name / "pilot.json"
        memory = PilotMemory(path, key)
    if opts.pilot == "auto" and base.pilot_slots:
        switch = PilotSwitch(memory)
        if not switch.on:  # remembered: PILOT costs more than it saves here
            store.set_pilot(False)
        return switch
    if memory is None or opts.pilot == "auto":
        return None
    return PilotSwitch(memory, fixed=opts.pilot == "on")


def allocate_store(store: ExpertStore, opts: StoreOptions, *, kv_bytes: int) -> None:
    """Plan every slot from one budget (now that the KV size is known), allocate, and pin
    what the pin rule chooses from the usage profile. A resident store needs nothing."""
    if not isinstance(store, TieredStore):
        return
    sizing: StoreSizing = store.sizing
    layers = store.layers
    n_exp = store.layout.n_experts
    usage = UsageProfile(max(layers) + 1, n_exp, sizing.model_type, layers)
    if opts.profile:
        usage.merge_file(Path(opts.profile))
    store.recorder.profile = usage
    work = min(n_exp, WORK_SLOTS)
    pilot_slots = 0 if opts.pilot == "off" else min(n_exp, PILOT_SLOTS)
    plan = partial(
        budgets.plan,
        total=sizing.total,
        source=sizing.source,
        dense=sizing.dense,
        kv=kv_bytes,
        slot_bytes=store.slot_bytes,
        n_layers=store.n_layers,
        n_experts=n_exp,
        work_slots=work,
        pilot_slots=pilot_slots,
        cache=opts.cache,
    )
    base = plan()
    room = base.total - base.dense - base.kv - base.reserve - base.work
    pin_first = opts.pin == "all" and opts.cache is None  # --pin all: pins before the cache
    budget = PinBudget.plan(
        opts.pin,
        expert_room=room,
        cache_room=0 if pin_first else base.cache_bytes,
        slot_bytes=store.slot_bytes,
        n_experts_total=n_exp * len(layers),
    )
    if budget.capacity:
        base = plan(pins=budget.capacity * store.slot_bytes)
    store.budget_plan = base
    store.profile_path = opts.profile if opts.save_profile else None
    if budget.capacity:
        store.recorder.heat = np.zeros(store.counts.shape, dtype=np.float64)  # REPIN
    store.allocate(
        base.cache_per_layer,
        work_slots=base.work_slots,
        pilot_slots=base.pilot_slots,
        pin_budget=budget,
    )
    if store.streams():
        store.pilot_switch = pilot_switch(store, opts, base)
    if opts.pin_at_start:
        store.apply_pins(usage.counts)
    if opts.memwatch:  # whenever experts stream, `--cache` included (it is the ceiling)
        from colibrid.store.memwatch import default_watch

        floor = None if opts.memory_floor_gb is None else int(opts.memory_floor_gb * budgets.GiB)
        store.memwatch = default_watch(base.total, store, floor=floor)
        store.memwatch_note = store.memwatch.describe(store)
    log.info("colibri: %s; %s; pins: %s", base.describe(), store.plan.describe(), store.pins.note)
