"""Expert order on disk learned from a usage profile (``colibri convert --order``).

Why: a cold token reads 8 experts per layer; when experts that fire together sit next
to each other, the reads of one layer land in fewer, larger regions of the file (fewer
seeks on spinning disks and cloud volumes, better readahead). Placement never changes
what is computed: only the byte layout moves, names stay the checkpoint's own.

Accepted profiles:

* JSON co-occurrence profile (written by the usage-profile issue)::

    {"format": "colibri-cooccurrence", "version": 1,
     "layers": {"3": {"counts": [c0, c1, ...], "pairs": [[a, b, n], ...]}, ...}}

  ``counts[e]``: selections of expert e; ``pairs``: how often a and b fired in the same
  token (symmetric, a != b).
* a ``.coli_usage`` text file (the daemon's and upstream's usage history): counts, plus
  the co-occurrence the tiered store keeps beside it in ``<file>.cooc.npz`` (array
  ``within`` [layers, experts, experts]) when that sidecar exists; without it, hottest
  experts first.

Order of a layer: start at the most-selected expert; repeatedly append the unplaced
expert that co-fired most with the last placed one (ties: more selections, then the
lower index); with no co-occurrence left, the most-selected unplaced expert. Layers the
profile does not mention keep numeric order.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from colibrid.errors import ConvertError

MAX_PROFILE_BYTES = 256 << 20


class ExpertOrderProfile:
    def __init__(
        self,
        counts: dict[int, dict[int, int]],
        pairs: dict[int, dict[tuple[int, int], int]],
        digest: str,
    ) -> None:
        self.counts = counts
        self.pairs = pairs
        self.digest = digest

    @classmethod
    def load(cls, path: str | Path) -> ExpertOrderProfile:
        p = Path(path)
        try:
            raw = p.read_bytes()[: MAX_PROFILE_BYTES + 1]
        except OSError as exc:
            raise ConvertError(f"{p}: cannot read usage profile ({exc.strerror})") from None
        if len(raw) > MAX_PROFILE_BYTES:
            raise ConvertError(f"{p}: usage profile larger than {MAX_PROFILE_BYTES} bytes")
        digest = hashlib.sha256(raw).hexdigest()
        counts: dict[int, dict[int, int]] = {}
        pairs: dict[int, dict[tuple[int, int], int]] = {}
        try:
            if raw.lstrip().startswith(b"{"):
                doc = json.loads(raw)
                for key, entry in doc["layers"].items():
                    layer = int(key)
                    counts[layer] = {e: int(c) for e, c in enumerate(entry.get("counts", []))}
                    for a, b, n in entry.get("pairs", []):
                        a, b, n = int(a), int(b), int(n)
                        if a != b and n > 0:
                            d = pairs.setdefault(layer, {})
                            d[(a, b)] = d.get((a, b), 0) + n
                            d[(b, a)] = d.get((b, a), 0) + n
            else:
                for line in raw.decode("ascii").splitlines():
                    fields = line.split()
                    if len(fields) != 3:
                        raise ValueError(f"line {line[:40]!r} has {len(fields)} fields")
                    layer, expert, n = map(int, fields)
                    if layer >= 0:
                        counts.setdefault(layer, {})[expert] = n
                _merge_sidecar(p, pairs)
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise ConvertError(f"{p}: not a usage profile ({exc})") from None
        return cls(counts, pairs, digest)

    def order(self, layer: int, experts: list[int]) -> list[int]:
        """``experts`` of ``layer`` in co-firing order (numeric where the profile is silent)."""
        if layer not in self.counts and layer not in self.pairs:
            return sorted(experts)
        ids = sorted(experts)
        pos = {e: i for i, e in enumerate(ids)}
        n = len(ids)
        cnt = np.array([self.counts.get(layer, {}).get(e, 0) for e in ids], dtype=np.int64)
        co = np.zeros((n, n), dtype=np.int64)
        for (a, b), c in self.pairs.get(layer, {}).items():
            if a in pos and b in pos:
                co[pos[a], pos[b]] = c
        placed = np.zeros(n, dtype=bool)
        # lexsort keys: lowest index wins final ties
        rank_hot = np.lexsort((np.arange(n), -cnt))
        out: list[int] = []
        last = -1
        for _ in range(n):
            nxt = -1
            if last >= 0:
                row = np.where(placed, -1, co[last])
                if row.max() > 0:
                    best = np.flatnonzero(row == row.max())
                    nxt = int(best[np.lexsort((best, -cnt[best]))[0]])
            if nxt < 0:
                nxt = int(next(i for i in rank_hot if not placed[i]))
            placed[nxt] = True
            out.append(ids[nxt])
            last = nxt
        return out


def _merge_sidecar(usage: Path, pairs: dict[int, dict[tuple[int, int], int]]) -> None:
    """Co-occurrence pairs from the store's ``<usage>.cooc.npz`` sidecar, when present."""
    sidecar = usage.with_name(usage.name + ".cooc.npz")
    if not sidecar.is_file():
        return
    try:
        with np.load(sidecar, allow_pickle=False) as z:
            within = np.asarray(z["within"])
    except (OSError, ValueError, KeyError) as exc:
        raise ConvertError(f"{sidecar}: not a co-occurrence sidecar ({exc})") from None
    if within.ndim != 3 or within.shape[1] != within.shape[2]:
        raise ConvertError(f"{sidecar}: 'within' must be [layers, experts, experts]")
    for layer, a, b in zip(*np.nonzero(within), strict=True):
        if a != b:
            d = pairs.setdefault(int(layer), {})
            d[(int(a), int(b))] = d.get((int(a), int(b)), 0) + int(within[layer, a, b])
