"""The device tier: which weights a backend keeps copies of in its own memory (GPU memory
for cuda, MLX arrays for mlx), under a byte budget.

Which copies stay is the RAM cache's kind of rule (colibrid.policy, gated LFRU): every use
of an expert's weight counts, held or not, and a weight not held displaces the coldest held
expert weight only when it has been used more (HeatGatedLFRU: heat alone decides, as each
admission costs a copy over the bus); otherwise it is copied for the op that needs it and
dropped after, or, in the I8 family, computed where its bytes are (backends/cuda.py). So a
token's streamed experts, each a weight seen once, no longer push out the experts RAM
holds for good and every token uses (with least-recently-used they did, and each token
copied them all again). Dense weights (attention, shared experts, the head) are used every
token: they are always kept, room made for them from the coldest experts first.

Which weights are held never changes a result: a backend computes the same arithmetic on
the same copy wherever the weight came from (and cuda's I8 the CPU kernels' bits on either
side), so placement stays token-invariant (docs/architecture.md). A copy goes when its
weight object goes (a streamed expert's view dies with its slot's fill), so the tier never
serves stale bytes. `ps` and /metrics show it through `Ops.device_tier()`.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from colibrid.backends.base import DeviceTierStats
from colibrid.errors import BackendError, first_line
from colibrid.formats.weights import QuantWeight
from colibrid.policy import Policy
from colibrid.policy.gated import HeatGatedLFRU

T = TypeVar("T")  # a backend's copy of a weight
A = TypeVar("A")  # whatever an allocation returns

HEAT_DECAY_USES = 1 << 16
"""Expert-weight uses between halvings of the device tier's heat: a per-layer RAM cache
halves every 256 of its layer's uses (32-64 tokens); the device tier sees every layer's
uses, three weights an expert, so about 36 tokens of GLM-5 (1,800 uses a token) or 180 of
the demo's."""


class DeviceTier(Generic[T]):
    """Copies of weights by weight object, made by ``copy`` and ``size(copy)`` bytes each,
    under ``budget`` bytes (None: no budget). Expert weights are kept by ``policy``
    (default: heat-gated LFRU, heat halved every HEAT_DECAY_USES uses), dense weights always,
    the least recently used of them out last, after every expert. An evicted copy's memory
    goes when the last op using it lets go of it."""

    def __init__(
        self,
        copy: Callable[[QuantWeight], T],
        size: Callable[[T], int],
        budget: int | None,
        policy: Policy | None = None,
    ) -> None:
        self._copy, self._size = copy, size
        self.stats = DeviceTierStats(budget=budget)
        self._dense: OrderedDict[int, tuple[T, int]] = OrderedDict()  # least recent first
        self._experts: dict[int, tuple[T, int]] = {}
        self._policy = policy if policy is not None else HeatGatedLFRU(HEAT_DECAY_USES)
        self._watched: set[int] = set()  # weights whose death drops their copy
        self._lock = threading.RLock()  # a finalizer may run inside get, on any thread

    def get(self, w: QuantWeight, expert: bool = False) -> T:
        """``w``'s copy: the held one, or one made now and kept when the policy keeps it;
        ``expert``: it is one of an expert's weights (kept by heat, counted apart)."""
        with self._lock:
            if not expert:
                return self._get_dense(w)
            held = self._keep(w)
            return held if held is not None else self._copy_once(w)

    def keep(self, w: QuantWeight) -> T | None:
        """An expert weight's copy when the tier holds it or keeps it now (its use counted
        either way); None, with no copy made, when the policy would only pass it through:
        the caller may compute it where its bytes are, or take ``copy_once``."""
        with self._lock:
            return self._keep(w)

    def copy_once(self, w: QuantWeight) -> T:
        """A copy of an expert weight for one op, not kept (its use counted by ``keep``)."""
        with self._lock:
            return self._copy_once(w)

    def promote(self, weights: Sequence[QuantWeight]) -> int:
        """Copy in expert ``weights`` (hottest first) while they fit the budget, evicting
        nothing; each counts as used once. Without a budget there is nothing to choose:
        every weight is copied at its first use anyway. Returns how many were copied."""
        budget = self.stats.budget
        if budget is None:
            return 0
        copied = 0
        with self._lock:
            for w in weights:
                key = id(w)
                if key in self._experts or key in self._dense:
                    continue
                if self.stats.bytes + w.nbytes > budget:
                    break
                self._policy.seen(key)
                self._admit(w)
                copied += 1
        return copied

    def _get_dense(self, w: QuantWeight) -> T:
        key = id(w)
        entry = self._dense.get(key)
        if entry is not None:
            self._dense.move_to_end(key)
            self.stats.hits += 1
            return entry[0]
        self._make_room(w.nbytes, dense=True)
        held, size = self._new_copy(w)
        self._dense[key] = (held, size)
        self._count(size, False, 1)
        return held

    def _keep(self, w: QuantWeight) -> T | None:
        key = id(w)
        entry = self._experts.get(key)
        if entry is not None:
            self._policy.touch(key)
            self.stats.hits += 1
            return entry[0]
        self._policy.seen(key)
        self._watch(w)  # its heat dies with it, even if it is never copied
        if not self._make_room(w.nbytes, dense=False, key=key):
            return None
        return self._admit(w)

    def _admit(self, w: QuantWeight) -> T:
        """Copy an expert weight in and keep it (its use already counted)."""
        held, size = self._new_copy(w)
        self._policy.admit(id(w))
        self._experts[id(w)] = (held, size)
        self._count(size, True, 1)
        return held

    def _copy_once(self, w: QuantWeight) -> T:
        held, _ = self._new_copy(w)
        self.stats.passed += 1
        return held

    def _make_room(self, nbytes: int, dense: bool, key: int = 0) -> bool:
        """Evict until ``nbytes`` more fit the budget (no peak over it): the policy's
        victims among the experts, for an expert weight (``key``) only those the policy
        lets it displace; then, for a dense weight, the least recently used dense
        weights. False: it does not fit (an expert weight passes through)."""
        budget = self.stats.budget
        while budget is not None and self.stats.bytes + nbytes > budget:
            victim = self._policy.victim()
            if victim is not None and (dense or self._policy.admits(key, victim)):
                self._evict(victim)
            elif dense and self._dense:
                self._evict(next(iter(self._dense)))
            else:
                return False
        return True

    def _new_copy(self, w: QuantWeight) -> tuple[T, int]:
        held = self.with_room(lambda: self._copy(w), f"a {w.nbytes / 2**20:.1f} MiB weight")
        size = self._size(held)
        self._watch(w)
        self.stats.copies += 1
        self.stats.copied_bytes += size
        return held, size

    def _watch(self, w: QuantWeight) -> None:
        """Forget ``w`` (copy and heat) when it dies: streamed experts' weights are views
        made again at every read, and a later weight may get a dead one's id, which must
        not inherit its heat (the tier would keep or pass it by another weight's uses)."""
        key = id(w)
        if key not in self._watched:
            self._watched.add(key)
            weakref.finalize(w, self._forget, key)

    def with_room(self, allocate: Callable[[], A], what: str) -> A:
        """``allocate()``; when the device is fuller than the budget assumed (another
        program's memory), again once with the tier emptied; then one clear error."""
        try:
            return allocate()
        except Exception:  # noqa: BLE001 - pycuda's and the emulation's errors differ
            with self._lock:
                for key in [*self._dense, *self._experts]:
                    self._evict(key)
            gc.collect()  # copies only cycles still hold go now
            try:
                return allocate()
            except Exception as exc:  # noqa: BLE001 - one line, as every backend error
                raise BackendError(
                    f"the device has no room for {what} even with the device tier emptied "
                    f"({first_line(exc)}); free device memory or use --backend cpu"
                ) from exc

    def _evict(self, key: int) -> None:
        entry = self._dense.pop(key, None)
        if entry is not None:
            self._count(entry[1], False, -1)
        entry = self._experts.pop(key, None)
        if entry is not None:
            self._policy.remove(key)
            self._count(entry[1], True, -1)

    def _count(self, size: int, expert: bool, sign: int) -> None:
        self.stats.weights += sign
        self.stats.bytes += sign * size
        if expert:
            self.stats.expert_weights += sign
            self.stats.expert_bytes += sign * size

    def _forget(self, key: int) -> None:
        """The weight is gone: so is its copy, and the id may now name another weight."""
        with self._lock:
            self._watched.discard(key)
            self._evict(key)
            self._policy.forget(key)
