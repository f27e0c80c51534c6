"""What a slot costs in memory, and what each expert keeps of it.

Why: a container with a precision plan (``colibri requant --by-heat``) holds experts of
several sizes — a cold int2-affine expert is about half an int4 one. Slots are all the
size of the largest expert, so that any free slot can take any read; but a slot that
holds a smaller expert in a tier (cached or pinned) gives the pages past that expert's
bytes back to the kernel (:meth:`colibrid.store.slabs.SlabArena.trim`) and costs only
what it keeps. The placement core counts a layer's cache, and the memory it keeps
faulted, in these bytes, so the same RAM budget holds more of the smaller experts
(docs/architecture.md, "Mixed precisions"). For a uniform container every expert keeps a
whole slot and the counts are the plain slot counts of before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

Key = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class SlotSizes:
    """``unit``: one slot's bytes; ``kept[layer][expert]``: the bytes a slot holding that
    expert keeps (``unit`` for the largest, and for any expert not listed)."""

    unit: int = 1
    kept: Mapping[int, Sequence[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.unit < 1:
            raise ValueError(f"a slot must have at least one byte, got {self.unit}")
        for layer, row in self.kept.items():
            if any(not 0 < k <= self.unit for k in row):
                raise ValueError(f"layer {layer}: an expert keeps more than a slot or nothing")

    @classmethod
    def of_slabs(cls, slabs: Mapping[int, Sequence[int]], quantum: int) -> SlotSizes:
        """From each expert's slab bytes (layer -> per expert), every size rounded up to
        ``quantum`` (a page: what a slot can give back), the unit the largest."""
        up = {la: tuple(-(-b // quantum) * quantum for b in row) for la, row in slabs.items()}
        unit = max((k for row in up.values() for k in row), default=quantum)
        return cls(unit, up)

    def of(self, key: Key) -> int:
        row = self.kept.get(key[0])
        return self.unit if row is None else row[key[1]]

    @cached_property  # asked on every slot take: computed once (the sizes never change)
    def smallest(self) -> int:
        return min((k for row in self.kept.values() for k in row), default=self.unit)

    @cached_property
    def mixed(self) -> bool:
        """Some expert keeps less than a whole slot."""
        return self.smallest < self.unit

    def most_per_layer(self, cache_per_layer: int, n_experts: int) -> int:
        """The most experts a layer's cache of ``cache_per_layer`` whole slots can hold:
        as many of the smallest as fit its bytes, never more than the layer has."""
        return min(n_experts, cache_per_layer * self.unit // self.smallest)
