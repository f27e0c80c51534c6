"""The RAM budget: how many experts per layer the cache may hold.

Why a plan and not a guess: the daemon must never be OOM-killed, so every byte it will
hold is accounted before anything big is allocated (upstream ``cap_for_ram``, docs/architecture.md):
dense weights + pins + cache slabs + work slabs + KV cache + a reserve for the page cache
and Python. An explicit ``--ram-gb`` is the total; the automatic budget is 88% of the
memory available at start-up. A budget that cannot hold the dense part is refused
before the model is loaded, with the numbers.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from colibrid.errors import ModelLoadError

GiB = 1 << 30
AUTO_FRACTION = 0.88
RESERVE_BYTES = int(1.2 * GiB)
RESERVE_FRACTION = 0.10
# When the budget is tight the fixed overhead shrinks before anything is refused: PILOT's
# slots first (no read-ahead), then the work slots down to two (one expert computing while
# the next is read), then the reserve down to this floor. Below that the model cannot run.
MIN_WORK_SLOTS = 2
RESERVE_FLOOR_BYTES = 64 << 20
RESERVE_FLOOR_FRACTION = 0.04


def mem_available() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if sys.platform == "darwin":  # free + inactive pages via sysconf is the best portable hint
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def process_rss() -> int:
    """Resident set size of this process in bytes (0 when unknown)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024
    except (ImportError, OSError):
        return 0


@dataclass(frozen=True)
class BudgetPlan:
    total: int
    dense: int
    kv: int
    reserve: int
    pins: int
    cache_per_layer: int  # experts per layer the cache may hold
    slot_bytes: int
    n_layers: int
    source: str  # "auto", "--ram-gb", "--cache"
    work_slots: int = 0  # slots a layer's demand misses stream through
    pilot_slots: int = 0  # slots PILOT reads ahead into
    note: str = ""  # what was shrunk to fit, if anything

    @property
    def work(self) -> int:
        """Bytes of the work and PILOT slots."""
        return (self.work_slots + self.pilot_slots) * self.slot_bytes

    @property
    def cache_bytes(self) -> int:
        return self.cache_per_layer * self.n_layers * self.slot_bytes

    def describe(self) -> str:
        g = GiB
        text = (
            f"budget {self.total / g:.1f} GiB ({self.source}): dense {self.dense / g:.2f}, "
            f"KV {self.kv / g:.2f}, work {self.work / g:.2f}, reserve {self.reserve / g:.2f},"
            f" pins {self.pins / g:.2f}, cache {self.cache_bytes / g:.2f} GiB = "
            f"{self.cache_per_layer} experts/layer x {self.n_layers} layers"
        )
        return f"{text} ({self.note})" if self.note else text


def resolve_total(ram_gb: float | None) -> tuple[int, str]:
    if ram_gb is not None:
        if ram_gb <= 0:
            raise ModelLoadError(f"--ram-gb must be positive, got {ram_gb}")
        return int(ram_gb * GiB), "--ram-gb"
    return int(mem_available() * AUTO_FRACTION), "auto"


def reserve_for(total: int) -> int:
    """The reserve a comfortable budget keeps for Python, numpy and the page cache."""
    return min(RESERVE_BYTES, int(total * RESERVE_FRACTION))


def reserve_floor(total: int) -> int:
    """The least reserve a tight budget may keep."""
    return min(reserve_for(total), max(RESERVE_FLOOR_BYTES, int(total * RESERVE_FLOOR_FRACTION)))


def minimum_budget(*, dense: int, kv: int, slot_bytes: int) -> int:
    """The smallest total that runs: dense + KV + two work slots + the reserve floor (the
    floor is a fraction of the total, hence the fixed point)."""
    need = dense + kv + MIN_WORK_SLOTS * slot_bytes
    total = need + RESERVE_FLOOR_BYTES
    for _ in range(8):
        total = need + reserve_floor(total)
    return total


def check_dense_fits(total: int, dense: int, source: str) -> None:
    """Refuse before loading when the dense part alone cannot fit."""
    reserve = reserve_floor(total)
    if dense + reserve > total:
        raise ModelLoadError(
            f"the dense weights need {dense / GiB:.2f} GiB (+{reserve / GiB:.2f} GiB reserve) "
            f"but the RAM budget ({source}) is {total / GiB:.2f} GiB; raise --ram-gb or free "
            "memory"
        )


def plan(
    *,
    total: int,
    source: str,
    dense: int,
    kv: int,
    slot_bytes: int,
    n_layers: int,
    n_experts: int,
    work_slots: int,
    pilot_slots: int = 0,
    pins: int = 0,
    cache: int | None = None,
) -> BudgetPlan:
    """Experts per layer that fit; ``cache`` (``--cache N``) overrides the budget.

    A budget too small for the full overhead degrades it instead of refusing (PILOT's
    slots, then work slots down to MIN_WORK_SLOTS, then the reserve down to its floor),
    and says so in ``note``; only a budget below `minimum_budget` is refused."""
    work_n, pilot_n = work_slots, pilot_slots
    reserve = reserve_for(total)
    notes: list[str] = []

    def room() -> int:
        return total - dense - kv - reserve - (work_n + pilot_n) * slot_bytes - pins

    if cache is None and room() < 0:
        check_dense_fits(total, dense, source)
        if pilot_n and room() < 0:
            pilot_n = max(0, pilot_n + room() // slot_bytes)  # room() < 0: floor division
            notes.append(f"PILOT slots {pilot_slots} -> {pilot_n}")
        floor_work = min(work_slots, MIN_WORK_SLOTS)
        if room() < 0 and work_n > floor_work:
            work_n = max(floor_work, work_n + room() // slot_bytes)
            notes.append(f"work slots {work_slots} -> {work_n}")
        if room() < 0:
            reserve = max(reserve_floor(total), reserve + room())
            notes.append(f"reserve {reserve / GiB:.2f} GiB")
        if room() < 0:
            least = minimum_budget(dense=dense, kv=kv, slot_bytes=slot_bytes) + pins
            raise ModelLoadError(
                f"RAM budget {total / GiB:.2f} GiB ({source}) is below this model's minimum "
                f"of {least / GiB:.2f} GiB (dense {dense / GiB:.2f} + KV cache "
                f"{kv / GiB:.2f} + {MIN_WORK_SLOTS} work slabs of {slot_bytes / 2**20:.0f} MiB"
                f" + reserve {reserve_floor(least) / GiB:.2f}); raise --ram-gb or lower the "
                "context"
            )
    if cache is not None:
        per_layer = max(0, min(int(cache), n_experts))
        source = "--cache"
    else:
        per_layer = max(0, min(n_experts, room() // max(1, n_layers * slot_bytes)))
    return BudgetPlan(
        total,
        dense,
        kv,
        reserve,
        pins,
        per_layer,
        slot_bytes,
        n_layers,
        source,
        work_slots=work_n,
        pilot_slots=pilot_n,
        note="tight budget: " + ", ".join(notes) if notes else "",
    )
