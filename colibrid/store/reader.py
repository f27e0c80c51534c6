"""The reader: expert extents on disk, the slab arena they land in, and the I/O pool.

Why apart from placement: this is the only part that touches files, threads and pages;
it fills a slot it is told to fill and reports completions, and never decides which
expert goes where (that is :mod:`colibrid.store.slots`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from colibrid.store.checkpoint import Checkpoint
from colibrid.store.experts import ExpertLayout, ExpertWeights
from colibrid.store.extents import ALIGN, ExpertExtents, ExtentPlanner
from colibrid.store.integrity import Digests
from colibrid.store.io_pool import BACKGROUND, DEMAND_READ, IOPool, ReadFiles, ReadStopped
from colibrid.store.slabs import PAGE, SlabArena
from colibrid.store.slot_sizes import SlotSizes
from colibrid.store.telemetry import Counters, now
from colibrid.store.weight_checks import ExpertChecks

Key = tuple[int, int]


class ExpertReader:
    """Extents of every routed expert (planned from headers only) and their reads."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        layout: ExpertLayout,
        *,
        direct: bool,
        io_threads: int,
        stats: Counters,
        extra_layers: dict[int, str] | None = None,
        digests: Digests | None = None,
    ) -> None:
        planner = ExtentPlanner(checkpoint, layout)
        templates: dict[int, str | None] = {la: layout.name_template for la in layout.moe_layers}
        templates.update(extra_layers or {})
        self.templates = templates
        self.extents: dict[int, list[ExpertExtents]] = {
            layer: [planner.plan(layer, e, t) for e in range(layout.n_experts)]
            for layer, t in sorted(templates.items())
        }
        self.slot_bytes = max(x.slab_bytes for row in self.extents.values() for x in row)
        self.expert_bytes = max(x.payload_bytes for row in self.extents.values() for x in row)
        # what each expert keeps of a slot in a tier (mixed precisions: less than a slot)
        self.sizes = SlotSizes.of_slabs(
            {la: [x.slab_bytes for x in row] for la, row in self.extents.items()},
            max(ALIGN, PAGE),
        )
        self.files = ReadFiles(planner.files, direct=direct)
        self.pool = IOPool(self.files, io_threads, unit_bytes=self.slot_bytes)
        self.stats = stats
        # each expert's first read is checked against the manifest's digests (see there)
        self.checks = (
            None
            if digests is None
            else ExpertChecks(checkpoint, digests, layout, templates, self.extents, stats)
        )
        self.arena: SlabArena | None = None
        self._views: list[tuple[Key | None, ExpertWeights | None]] = []

    def payload_bytes(self) -> int:
        return sum(x.payload_bytes for row in self.extents.values() for x in row)

    def allocate(self, n_slots: int) -> SlabArena:
        """The arena, not pre-faulted: placement faults in what the plan needs now."""
        self.arena = SlabArena(self.slot_bytes, max(1, n_slots), prefault=False)
        self._views = [(None, None)] * self.arena.n_slots
        return self.arena

    def read(self, slot: int, key: Key, *, background: bool) -> None:
        ext = self.extents[key[0]][key[1]]
        assert self.arena is not None
        self.stats.bytes_read += ext.read_bytes
        if background:
            self.stats.prefetch_bytes += ext.read_bytes
        self.pool.submit(
            slot,
            ext.reads,
            self.arena.memview(slot),
            BACKGROUND if background else DEMAND_READ,
            check=None if self.checks is None else self.checks.for_read(key),
        )

    def withdraw(self, slot: int, key: Key) -> bool:
        """Cancel a background read no worker has started (its bytes are not counted)."""
        if not self.pool.cancel(slot):
            return False
        nbytes = self.extents[key[0]][key[1]].read_bytes
        self.stats.bytes_read -= nbytes
        self.stats.prefetch_bytes -= nbytes
        return True

    def stop(self, slot: int) -> bool:
        """Stop a background read a worker is doing (its unread bytes are not counted);
        True when its completion will report it stopped."""
        return self.pool.stop(slot)

    def promote(self, slot: int) -> None:
        self.pool.promote(slot)

    def completed(self) -> bool:
        """A completion is waiting (non-blocking)."""
        return not self.pool.done.empty()

    def next_completion(self) -> tuple[int, BaseException | None]:
        """Wait for one read to complete: (slot, error or None); the wait is io-wait."""
        t0 = now()
        tag, _n, err = self.pool.done.get()
        self.stats.io_wait_s += now() - t0
        if isinstance(err, ReadStopped):
            self.stats.bytes_read -= err.unread
            self.stats.prefetch_bytes -= err.unread
            self.stats.pilot_stopped += 1
        return tag, err

    def view(self, slot: int, key: Key) -> ExpertWeights:
        """The expert's three weights over the slot's bytes, built once per (slot, expert):
        they are views of the slot's memory, so a later fill with the same expert (after
        a failed read, or a park) makes the same views valid again."""
        cached_key, weights = self._views[slot]
        if cached_key != key or weights is None:
            assert self.arena is not None
            weights = self.extents[key[0]][key[1]].views(self.arena.slot(slot))
            self._views[slot] = (key, weights)
        return weights

    def fault_in(self, slot: int) -> None:
        assert self.arena is not None
        self.arena.fault_in(slot)

    def fault_in_many(self, slots: Sequence[int]) -> None:
        assert self.arena is not None
        self.arena.fault_in_many(slots)

    def fault_in_background(self, slots: Sequence[int], skip: Callable[[int], bool]) -> None:
        assert self.arena is not None
        self.arena.fault_in_background(slots, skip)

    def trim(self, slot: int, keep: int) -> None:
        assert self.arena is not None
        self.arena.trim(slot, keep)

    def park(self, slot: int) -> None:
        assert self.arena is not None
        self.arena.release(slot)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.stop_background()
        self.pool.close()
        self.files.close()
