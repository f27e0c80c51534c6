"""The RAM budget: how many experts per layer the cache may hold.

Why a plan and not a guess: the daemon must never be OOM-killed, so every byte it will
hold is accounted before anything big is allocated (upstream ``cap_for_ram``, DESIGN §4):
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
    work: int
    reserve: int
    pins: int
    cache_per_layer: int  # experts per layer the cache may hold
    slot_bytes: int
    n_layers: int
    source: str  # "auto", "--ram-gb", "--cache"

    @property
    def cache_bytes(self) -> int:
        return self.cache_per_layer * self.n_layers * self.slot_bytes

    def describe(self) -> str:
        g = GiB
        return (
            f"budget {self.total / g:.1f} GiB ({self.source}): dense {self.dense / g:.2f}, "
            f"KV {self.kv / g:.2f}, work {self.work / g:.2f}, reserve {self.reserve / g:.2f},"
            f" pins {self.pins / g:.2f}, cache {self.cache_bytes / g:.2f} GiB = "
            f"{self.cache_per_layer} experts/layer x {self.n_layers} layers"
        )


def resolve_total(ram_gb: float | None) -> tuple[int, str]:
    if ram_gb is not None:
        if ram_gb <= 0:
            raise ModelLoadError(f"--ram-gb must be positive, got {ram_gb}")
        return int(ram_gb * GiB), "--ram-gb"
    return int(mem_available() * AUTO_FRACTION), "auto"


def check_dense_fits(total: int, dense: int, source: str) -> None:
    """Refuse before loading when the dense part alone cannot fit."""
    reserve = min(RESERVE_BYTES, int(total * RESERVE_FRACTION))
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
    pins: int = 0,
    cache: int | None = None,
) -> BudgetPlan:
    """Experts per layer that fit; ``cache`` (``--cache N``) overrides the budget."""
    reserve = min(RESERVE_BYTES, int(total * RESERVE_FRACTION))
    work = work_slots * slot_bytes
    if cache is not None:
        per_layer = max(0, min(int(cache), n_experts))
        source = "--cache"
    else:
        room = total - dense - kv - reserve - work - pins
        if room < 0 and dense + reserve <= total:
            raise ModelLoadError(
                f"RAM budget {total / GiB:.2f} GiB ({source}) holds the dense weights but not "
                f"the KV cache ({kv / GiB:.2f} GiB) and {work_slots} work slabs "
                f"({work / GiB:.2f} GiB); raise --ram-gb or lower the context"
            )
        check_dense_fits(total, dense, source)
        per_layer = max(0, min(n_experts, room // max(1, n_layers * slot_bytes)))
    return BudgetPlan(
        total, dense, kv, work, reserve, pins, per_layer, slot_bytes, n_layers, source
    )
