"""The memory side of a tiered store, built whole from one slot plan.

Why one object: the arena, the placement core, PILOT's prefetcher, the completions, the
layer server and the pin moves only make sense together (each holds the others), and
they exist only once the budget is known. Built in one constructor, they are either all
there or none is, so the store asks one question ("is the memory planned?") instead of
five, and a re-plan (tests, tools) replaces them all at once.
"""

from __future__ import annotations

from colibrid.store.completions import Completions
from colibrid.store.pin_moves import PinMoves
from colibrid.store.prefetch import Prefetcher
from colibrid.store.reader import ExpertReader
from colibrid.store.serving import LayerServer
from colibrid.store.slots import CACHED, PINNED, Placement, SlotPlan
from colibrid.store.telemetry import Counters


class Tiers:
    """The slab arena and every part that moves experts through it (engine thread only).

    ``plan`` fixes the slots; the arena is created here and pre-faulted in the
    background, beginning with the slots the free list hands out first.
    """

    def __init__(
        self,
        plan: SlotPlan,
        reader: ExpertReader,
        stats: Counters,
        *,
        policy: str,
        n_experts: int,
    ) -> None:
        reader.allocate(plan.total)
        self.placement = placement = Placement(
            plan,
            tuple(reader.extents),
            policy,
            fault_in=reader.fault_in,
            park=reader.park,
            trim=reader.trim,
            sizes=reader.sizes,
        )
        # Pre-fault: untouched RAM fills slowly later. In the background where the kernel
        # can populate without writing, the slots taken first (the free list's end) first;
        # a slot parked meanwhile, or already holding a smaller expert in a tier (its tail
        # given back), is passed over (one racing its park keeps its pages).
        held = (CACHED, PINNED)
        reader.fault_in_background(
            placement.free[::-1],
            skip=lambda slot: slot in placement.parked or placement.state[slot] in held,
        )
        self.prefetcher = Prefetcher(placement, reader, stats)
        self.completions = Completions(placement, reader, self.prefetcher)
        self.server = LayerServer(
            placement, reader, self.prefetcher, self.completions, stats, reader.extents, n_experts
        )
        self.moves = PinMoves(placement, reader, self.prefetcher, self.completions, self.quiesce)

    def quiesce(self) -> None:
        """Between passes: finish the last delivery and place what landed."""
        self.server.abandon()
        self.server.finish_held()
        self.completions.poll()
        self.completions.drain()
