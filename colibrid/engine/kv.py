"""The KV cache of one sequence: per layer, named float32 arrays indexed by position.

Each attention kind declares what it caches per token (GQA: keys and values per KV head;
MLA: the 512-float compressed latent plus the 64-float rotary key, i.e. 576 floats per
token per layer on GLM-5; DSA full layers add the indexer key). Storage grows by doubling
up to the context limit, so a short chat does not pay for a 200k-token reservation.

A forward writes rows [length, length + S) in every layer and then `advance(S)` commits
them; `truncate(n)` drops a suffix (prefix reuse, rejected drafts); `copy_prefix(n)`
starts another sequence from a shared prefix.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from colibrid.errors import RequestError


def bytes_per_position(layouts: list[Mapping[str, tuple[int, ...]]]) -> int:
    """Bytes one token's entries take across every layer (float32): what a sequence
    costs per position of context, and what one attention pass reads per cached token."""
    return sum(4 * int(np.prod(shape)) for layout in layouts for shape in layout.values())


class KVCache:
    def __init__(
        self,
        layouts: list[Mapping[str, tuple[int, ...]]],
        max_tokens: int,
        initial_tokens: int = 256,
    ) -> None:
        self.layouts = layouts
        self.max_tokens = max_tokens
        self.length = 0
        self._capacity = min(initial_tokens, max_tokens)
        self._arrays: list[dict[str, np.ndarray]] = [
            {
                name: np.zeros((self._capacity, *shape), dtype=np.float32)
                for name, shape in layout.items()
            }
            for layout in layouts
        ]

    def write(self, layer: int, name: str, rows: np.ndarray) -> np.ndarray:
        """Store rows [S, ...] at positions [length, length+S); return the view [:length+S]."""
        end = self.length + rows.shape[0]
        self._reserve(end)
        array = self._arrays[layer][name]
        array[self.length : end] = rows
        return array[:end]

    def arrays_for(self, layer: int, rows: int) -> dict[str, np.ndarray]:
        """The layer's whole arrays, with room for ``rows`` more positions: a native block
        writes rows [length, length + rows) itself (what `write` does from Python)."""
        self._reserve(self.length + rows)
        return self._arrays[layer]

    def read(self, layer: int, name: str, end: int) -> np.ndarray:
        return self._arrays[layer][name][:end]

    def advance(self, n: int) -> None:
        self.length += n

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {n}")
        self.length = n

    def position(self, p: int) -> list[dict[str, np.ndarray]]:
        """A copy of every layer's row at position ``p`` (held or not: rows past
        ``length`` are whatever the last pass left there)."""
        if not 0 <= p < self._capacity:
            raise ValueError(f"position {p} outside a cache of capacity {self._capacity}")
        return [{name: array[p].copy() for name, array in layer.items()} for layer in self._arrays]

    def put_position(self, p: int, rows: list[dict[str, np.ndarray]]) -> None:
        """Put back rows taken by `position` (verifying a position rewrites it)."""
        for layer, saved in zip(self._arrays, rows, strict=True):
            for name, row in saved.items():
                layer[name][p] = row

    def copy_prefix(self, n: int) -> KVCache:
        """A new cache holding a copy of the first ``n`` positions (a shared prompt prefix
        reused by another sequence while this one stays as it is)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot copy {n} positions of a cache of {self.length}")
        copy = KVCache(self.layouts, self.max_tokens, initial_tokens=max(n, 1))
        for mine, theirs in zip(self._arrays, copy._arrays, strict=True):
            for name, array in mine.items():
                theirs[name][:n] = array[:n]
        copy.length = n
        return copy

    def nbytes(self) -> int:
        return sum(a.nbytes for layer in self._arrays for a in layer.values())

    def _reserve(self, tokens: int) -> None:
        if tokens <= self._capacity:
            return
        if tokens > self.max_tokens:
            raise RequestError(
                f"context of {tokens} tokens exceeds the limit of {self.max_tokens}",
                code="CONTEXT_EXCEEDED",
            )
        capacity = min(max(tokens, 2 * self._capacity), self.max_tokens)
        for layer in self._arrays:
            for name, old in layer.items():
                grown = np.zeros((capacity, *old.shape[1:]), dtype=np.float32)
                grown[: self.length] = old[: self.length]
                layer[name] = grown
        self._capacity = capacity
