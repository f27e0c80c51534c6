"""Least-recently-used: evict the entry whose last use is oldest."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container


class LRU:
    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def touch(self, key: int) -> None:
        self._order.move_to_end(key)

    def seen(self, key: int) -> None:
        """A lookup that missed: LRU keeps no history of uncached keys."""

    def admit(self, key: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: int) -> None:
        self._order.pop(key, None)

    def forget(self, key: int) -> None:
        self.remove(key)

    def victim(self, protected: Container[int] = ()) -> int | None:
        for key in self._order:
            if key not in protected:
                return key
        return None

    def admits(self, key: int, victim: int) -> bool:
        return True
