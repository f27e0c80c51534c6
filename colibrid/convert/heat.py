"""A per-expert precision plan from a usage profile: hot experts keep (or get) more bits,
cold ones fewer.

Why by heat: when experts stream, a token costs the bytes of the experts it needs that
are not in memory, and those are by definition the cold ones; an expert the router
rarely picks also contributes little to the outputs. So the experts carrying most of a
layer's selections stay precise and the rarely chosen ones shrink.

The rule (a pure function of the counts and the options, so a plan is reproducible):
in every MoE layer the experts are ranked by their selection count in the profile,
highest first, ties to the lower index; the first ``round(hot_share * E)`` are *hot*
(``hot_bits``), the last ``round(cold_share * E)`` are *cold* (``cold_bits``) and the
rest keep ``bits``. Shares are of a layer's experts, not of its selections, so the bytes
a plan saves are known before any text is run; the share of the selections the cold
experts carried in the profile is reported beside it (:attr:`HeatPlan.cold_traffic`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from colibrid.errors import ConvertError

BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class HeatOptions:
    """What a plan is made from besides the profile (recorded in the manifest)."""

    hot_share: float = 0.0
    hot_bits: int = 8
    cold_share: float = 0.5
    cold_bits: int = 3
    bits: int = 4  # everything neither hot nor cold

    def check(self) -> None:
        for name in ("hot_bits", "cold_bits", "bits"):
            if getattr(self, name) not in BITS:
                raise ConvertError(
                    f"--{name.replace('_', '-')} {getattr(self, name)}: choose from {BITS}"
                )
        for name in ("hot_share", "cold_share"):
            share = getattr(self, name)
            if not (0.0 <= share <= 1.0) or not math.isfinite(share):
                raise ConvertError(f"--{name.replace('_', '-')} {share}: a share in [0, 1]")
        if self.hot_share + self.cold_share > 1.0 + 1e-9:
            raise ConvertError(
                f"--hot-share {self.hot_share} + --cold-share {self.cold_share} exceed 1"
            )

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def _count(share: float, n: int) -> int:
    return int(math.floor(share * n + 0.5))  # half up: 0.5 of 16 experts is 8, of 3 is 2


@dataclass(frozen=True)
class HeatPlan:
    """Bits for every (layer, expert) of the MoE layers, and what the profile says."""

    bits: dict[tuple[int, int], int]
    cold_traffic: float  # share of the profile's selections that went to cold experts
    hot_traffic: float
    selections: int  # selections in the profile over the planned layers

    def count(self, bits: int) -> int:
        return sum(1 for b in self.bits.values() if b == bits)


def plan_by_heat(
    counts: np.ndarray, layers: Sequence[int], n_experts: int, opts: HeatOptions
) -> HeatPlan:
    """Assign each routed expert of ``layers`` its bits from the profile ``counts``
    [>= max(layers)+1, n_experts] (module rule)."""
    opts.check()
    n_hot, n_cold = _count(opts.hot_share, n_experts), _count(opts.cold_share, n_experts)
    n_cold = min(n_cold, n_experts - n_hot)
    bits: dict[tuple[int, int], int] = {}
    hot = cold = total = 0
    for layer in layers:
        row = np.asarray(counts[layer], dtype=np.int64) if layer < len(counts) else None
        if row is None:
            row = np.zeros(n_experts, dtype=np.int64)
        ranked = sorted(range(n_experts), key=lambda e: (-int(row[e]), e))
        for rank, expert in enumerate(ranked):
            if rank < n_hot:
                b = opts.hot_bits
                hot += int(row[expert])
            elif rank >= n_experts - n_cold:
                b = opts.cold_bits
                cold += int(row[expert])
            else:
                b = opts.bits
            bits[layer, expert] = b
        total += int(row.sum())
    return HeatPlan(bits, cold / total if total else 0.0, hot / total if total else 0.0, total)
