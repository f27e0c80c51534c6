"""Types shared by every backend: kernel families and the batch of experts one call
applies. The weight formats and the quantised weight type they compute on live in
:mod:`colibrid.formats.weights`.

Shape legend used across kernels and models: S rows (tokens), I input features,
O output features, D hidden size, F expert FFN width.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from colibrid.errors import BackendError
from colibrid.formats.weights import QuantWeight


class KernelFamily(enum.Enum):
    """The arithmetic a kernel uses; always chosen explicitly by the caller (docs/architecture.md).

    F32: activations stay f32; quantised weights are expanded to f32 in registers and
         accumulated in f32. Matches a reference that uses the dequantised weights.
    I8:  activations are quantised per row to int8 (absmax/127, round half to even),
         dot products are integer, then scaled. Bit-exact across ISAs; lossy, so opt-in.

    In both families row s of a batch of S rows is computed with exactly the arithmetic
    of a single-row call on row s: the batch size never changes a result.
    """

    F32 = "f32"
    I8 = "i8"


def require_family(backend: str, families: Collection[KernelFamily], family: KernelFamily) -> None:
    """The one-line refusal of ``family`` by a backend that computes only ``families``:
    said when a model is loaded, when the daemon starts (before a weight is mapped), and
    by the ops of a backend that has no integer contract (mlx) if asked anyway."""
    if family not in families:
        raise BackendError(
            f"the {backend} backend computes the "
            f"{', '.join(sorted(f.value for f in families))} kernel family only, not "
            f"{family.value} (--kernel-family, or kernel_family in the daemon's config.toml)"
        )


class SwiGLUWeights(Protocol):
    """An expert's (or a dense MLP's) three projections: gate/up [F, D], down [D, F]."""

    gate: QuantWeight
    up: QuantWeight
    down: QuantWeight


class ResidentExperts:
    """Every routed expert of one MoE layer, held in memory for good, indexed by expert id:
    what a store hands ``Ops.moe`` so the whole layer is one backend call. An object of
    its own (not a bare list) so a backend may keep its prepared form of the layer on it
    for as long as the layer lives, and no longer."""

    def __init__(self, experts: Sequence[SwiGLUWeights]) -> None:
        self.experts = experts

    def __len__(self) -> int:
        return len(self.experts)


@dataclass(frozen=True)
class ExpertBatch:
    """Experts to apply in one call and where each result goes.

    Expert e (``weights[e]``) owns the pairs p in ``[start[e], start[e + 1])``: it is
    applied to row ``rows[p]`` of the input, scaled by ``gates[p]`` and written to row
    ``dest[p]`` of the output. Plain lists: a decode step has a handful of pairs and
    building arrays for them cost more than the arithmetic on small models.
    """

    weights: Sequence[SwiGLUWeights]
    start: list[int]
    rows: list[int]
    gates: list[float]
    dest: list[int]


@dataclass
class DeviceTierStats:
    """What a backend holds in device memory (the VRAM tier of `ps` and /metrics):
    weights and their bytes under the tier's budget, how many of them belong to routed
    experts, and since the start: the uses served from it, the copies in, and of those the
    expert weights passed through (copied for one op, colder than what the tier held)."""

    weights: int = 0
    bytes: int = 0
    budget: int | None = None  # bytes; None: the tier has none
    device: str = ""  # the adapter and the API it is driven through, for `ps`
    expert_weights: int = 0
    expert_bytes: int = 0
    hits: int = 0
    copies: int = 0  # weights copied in (a miss each)
    copied_bytes: int = 0
    passed: int = 0  # of the copies, expert weights not kept
    host_experts: int = 0  # expert uses computed on the host instead (cuda, I8)
    host_rule: str = ""  # where such experts go and the times that decided it

    @property
    def hit_rate(self) -> float | None:
        """The share of weight uses served from the tier (None before any use)."""
        uses = self.hits + self.copies
        return self.hits / uses if uses else None


@runtime_checkable
class DeviceLimits(Protocol):
    """A backend with a device of its own (cuda, webgpu) measures that device's limits:
    what the benches print their figures beside."""

    def limits(self, nbytes: int = 256 << 20) -> tuple[float, str]:
        """The device's read probe (GB/s) over ``nbytes``, and a line saying it and the
        host-to-device copy rate."""
        ...


@dataclass(frozen=True)
class RouteRule:
    """The router's rule: the ``top_k`` best experts by selection score, only the best
    ``topk_group`` of ``n_group`` groups competing; gates divided by their sum when
    ``norm``, times ``scaling``. Scores are per-expert sigmoids (GLM-4.x/5.x, DeepSeek-V3)
    or, with ``softmax``, the softmax over all experts (Qwen3-MoE, Mixtral, OLMoE)."""

    top_k: int
    n_group: int = 1
    topk_group: int = 1
    norm: bool = True
    scaling: float = 1.0
    softmax: bool = False


@dataclass(frozen=True, eq=False)
class GQAWeights:
    """One GQA attention block's resident weights: projections, optional q/k/v biases and
    q/k RMSNorm weights (with their epsilon), plus the two per-layer choices the block's
    arithmetic depends on. Built once per layer, so a backend may keep what it checked
    about it on the object.

    ``qk_norm_whole``: the norms span each row's whole q and k projections (OLMoE, weights
    [H * d] and [G * d]) instead of each head (GLM-4.x, Qwen3-MoE, weights [d]).
    ``window``: a row at position p attends to keys t > p - window only (Mixtral's
    ``sliding_window``); None means every causal key. ``sinks`` [H]: a logit per query
    head that joins each row's softmax and attends to nothing (gpt-oss)."""

    q: QuantWeight
    k: QuantWeight
    v: QuantWeight
    o: QuantWeight
    biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    qk_norm: tuple[np.ndarray, np.ndarray] | None = None
    eps: float = 1e-6
    qk_norm_whole: bool = False
    window: int | None = None
    sinks: np.ndarray | None = None
