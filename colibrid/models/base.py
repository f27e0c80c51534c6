"""What every model family shares: validated config arguments, the weight source seam,
linear layers and the per-forward step record.

Models never import the store or a backend: they receive a `WeightSource` (the
checkpoint), an `ExpertSource` (the expert store) and `Ops` (the backend's compute) from
the engine, so the store and the backends can change without touching model code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from colibrid.backends.base import (
    DeviceTierStats,
    ExpertBatch,
    GQAWeights,
    KernelFamily,
    ResidentExperts,
    RouteRule,
    SwiGLUWeights,
)
from colibrid.errors import ConfigError
from colibrid.formats.weights import QuantWeight, WeightLayout

# Hard bounds on config values: anything outside is refused before a byte is allocated,
# because config.json comes from untrusted mirrors (an absurd size is an attack, not a model).
MAX_DIM = 1 << 17  # hidden sizes, FFN widths, head dims, ranks
MAX_LAYERS = 1024
MAX_HEADS = 4096
MAX_EXPERTS = 1 << 16
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 24


class WeightSource(Protocol):
    """The dense-weight side of a checkpoint (implemented by store.checkpoint.Checkpoint)."""

    def has(self, name: str) -> bool: ...

    def weight(self, name: str, shape: tuple[int, int]) -> QuantWeight: ...

    def vector(self, name: str, shape: tuple[int, ...]) -> np.ndarray: ...

    def dense_f32(self, name: str, shape: tuple[int, int]) -> np.ndarray: ...


class ExpertSource(Protocol):
    """Where routed experts come from (implemented by the store; placement is its business)."""

    def record(self, layer: int, experts: Sequence[int]) -> None: ...

    def iter_groups(self, layer: int, experts: Sequence[int]) -> Iterator[list[tuple[int, Any]]]:
        """Lists of (expert, weights) pairs: first every expert in memory now (possibly
        none), then one or more at a time as reads land; a list is valid until the next
        one is asked for. Misses start reading in this call."""

    def resident(self, layer: int) -> ResidentExperts | None:
        """All of the layer's experts when they stay in memory for good, else None."""


def apply_experts_each(
    ops: Ops, batch: ExpertBatch, x: np.ndarray, out: np.ndarray, family: KernelFamily
) -> None:
    """`Ops.apply_experts` one expert at a time through `Ops.expert_swiglu`: the
    definition every backend's batched form must match bit for bit."""
    for e, w in enumerate(batch.weights):
        lo, hi = batch.start[e], batch.start[e + 1]
        if lo == hi:
            continue
        xs = np.ascontiguousarray(x[batch.rows[lo:hi]])
        y = ops.expert_swiglu(w.gate, w.up, w.down, xs, family)
        y *= np.asarray(batch.gates[lo:hi], dtype=np.float32)[:, None]
        out[batch.dest[lo:hi]] = y


def rank_sum_each(parts: np.ndarray) -> np.ndarray:
    """`Ops.rank_sum` in numpy: [S, R, D] summed over R in rank order from zero."""
    out = np.zeros((parts.shape[0], parts.shape[2]), dtype=np.float32)
    for r in range(parts.shape[1]):
        out += parts[:, r]
    return out


class Ops(Protocol):
    """The compute a model may call; every quantised op takes the kernel family explicitly."""

    name: str
    """The backend's name as `--backend` spells it (cpu, mlx, ...)."""

    families: frozenset[KernelFamily]
    """The kernel families this backend computes: Engine.load refuses any other before it
    maps a weight, rather than at the first token."""

    def prepare(self, layouts: Mapping[WeightLayout, int]) -> None:
        """Before the first compute: the weight layouts the model holds, each with its
        largest row count, so the backend can fix its kernels for them (the CPU backend
        measures each layout on every ISA once per machine; see backends.calibrate)."""
        ...

    def matmul(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray: ...

    def matmul_many(
        self, weights: Sequence[QuantWeight], x: np.ndarray, family: KernelFamily
    ) -> list[np.ndarray]:
        """[matmul(w, x) for w in weights] (all of the same I) in one backend call."""
        ...

    def matmul_blocks(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        """Block-diagonal: W's rows in x.shape[-2] equal blocks, block b times x[..., b, :]."""
        ...

    def expert_swiglu(
        self,
        gate: QuantWeight,
        up: QuantWeight,
        down: QuantWeight,
        x: np.ndarray,
        family: KernelFamily,
    ) -> np.ndarray: ...

    def apply_experts(
        self, batch: ExpertBatch, x: np.ndarray, out: np.ndarray, family: KernelFamily
    ) -> None:
        """Every expert of `batch` on its rows of x [S, D], gated, into rows of out [R, D];
        bit-identical to `apply_experts_each` (one `expert_swiglu` per expert)."""
        ...

    def rank_sum(self, parts: np.ndarray) -> np.ndarray:
        """parts [S, R, D] summed over R in order, starting from zero: [S, D]."""
        ...

    def moe(
        self,
        x: np.ndarray,
        weight: np.ndarray,
        bias: np.ndarray | None,
        rule: RouteRule,
        layer: ResidentExperts,
        shared: SwiGLUWeights | None,
        family: KernelFamily,
    ) -> tuple[np.ndarray, np.ndarray]:
        """A MoE layer whose experts are all in memory, in one call, routed by the
        router ``weight``, ``bias`` and ``rule`` (as `route`): (the routed ids
        [S, top_k] best first, the layer's output [S, D]), bit-identical to
        ``layers.moe.moe_each`` (route, the chosen experts and the shared one through
        apply_experts, rank_sum)."""
        ...

    def route(
        self, h: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, rule: RouteRule, n: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The MoE router, sigmoid or softmax as ``rule`` says (layers.router.route_reference
        is the rule): the n best experts per row best first, int64 [S, n], and the gates of
        the first top_k."""
        ...

    def gqa_attention(
        self,
        block: GQAWeights,
        rope: tuple[np.ndarray, np.ndarray],
        x: np.ndarray,
        caches: tuple[np.ndarray, np.ndarray],
        start: int,
        scale: float,
        family: KernelFamily,
    ) -> np.ndarray:
        """A GQA block: projections (+ biases), optional qk RMSNorm (per head or over the
        whole projection), RoPE, k/v written to cache rows [start, start + S), attention
        (within the block's sliding window, if any), output projection; bit-identical to
        backends.gqa_plan.gqa_attention_each (the same ops one by one)."""
        ...

    def rope_half(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """rotate_half RoPE of x [S, H, d] by cos/sin [S, half] (see layers.rope.apply_half)."""
        ...

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """RMSNorm over the last axis in float32, each row alone (S rows equal S calls)."""
        ...

    def add_rms_norm(
        self, h: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """(h + delta, rms_norm(h + delta, weight, eps)): a residual add and its norm."""
        ...

    def attend_gqa(
        self,
        q: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        scale: float,
        start: int,
        window: int | None = None,
        sinks: np.ndarray | None = None,
    ) -> np.ndarray:
        """Causal attention of q [S, H, d] (positions start..) over the cached keys and
        values [T, G, d]; query head h reads KV head h // (H / G); with ``window`` the row
        at position p sees keys t > p - window only; ``sinks`` [H] is one more logit per
        head in the softmax, attending to nothing (gpt-oss; layers.sinks is the rule).
        Returns [S, H * d]."""
        ...

    def embed(self, table: QuantWeight, ids: np.ndarray) -> np.ndarray: ...

    def device_tier(self) -> DeviceTierStats | None:
        """A copy of the backend's device tier now (backends.device_tier: GPU memory for
        cuda, MLX arrays for mlx); None for a backend that computes on the weights where
        the store keeps them (cpu)."""
        ...

    def promote(self, experts: Sequence[SwiGLUWeights]) -> int:
        """Experts a usage profile ranks hottest, hottest first, all in host memory: a
        backend whose device tier has a budget copies in those that fit now, evicting
        nothing, so a warmed profile starts on the device (each counted as used once).
        Returns how many weights it copied; 0 for a backend without such a tier."""
        ...


@dataclass
class PassClock:
    """Seconds a forward pass spent in attention (the store times the experts itself), so
    telemetry can split a token's time into I/O wait, experts, attention and the rest."""

    attention_s: float = 0.0


@dataclass(frozen=True)
class Step:
    """One sequence's part of a forward pass: where its new rows start, which arithmetic
    to use, and a hook called before each layer with its index (the engine uses it to
    abandon a cancelled prefill and to report a long prefill's progress)."""

    start: int  # absolute position of the sequence's first new token
    family: KernelFamily
    between_layers: Callable[[int], None] | None = None
    clock: PassClock | None = None


@dataclass(frozen=True)
class Segment:
    """The rows one sequence contributes to a forward pass: ``rows`` consecutive rows of
    the pass, written to ``cache`` from ``step.start`` on.

    Why several: a pass may carry the next tokens of several requests at once (batched
    decode) or several positions of one (a speculative verify). Attention runs per
    segment over its own cache; everything else (norms, router, experts, head) takes all
    rows together, so each expert a layer needs is fetched once for every row. Every
    operation computes a row alone, so a row gets the same bits whatever shares its pass.
    """

    cache: Any
    step: Step
    rows: int


class ConfigReader:
    """Reads config.json values with types and bounds, failing with one line naming the key."""

    def __init__(self, config: dict[str, Any], arch: str) -> None:
        if not isinstance(config, dict):
            raise ConfigError("config.json must be a JSON object")
        self.config = config
        self.arch = arch

    def _fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"config.json ({self.arch}): '{key}' {problem}")

    def int(self, key: str, default: int | None = None, *, lo: int = 1, hi: int = MAX_DIM) -> int:
        value = self.config.get(key, default)
        if value is None:
            raise self._fail(key, "is missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(key, f"must be an integer, got {value!r}")
        if not lo <= value <= hi:
            raise self._fail(key, f"= {value} is outside [{lo}, {hi}]")
        return value

    def optional_int(self, key: str, *, lo: int = 1, hi: int = MAX_DIM) -> int | None:
        if self.config.get(key) is None:
            return None
        return self.int(key, lo=lo, hi=hi)

    def float(
        self, key: str, default: float | None = None, *, lo: float = 0.0, hi: float = 1e12
    ) -> float:
        value = self.config.get(key, default)
        if value is None:
            raise self._fail(key, "is missing")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._fail(key, f"must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value) or not lo <= value <= hi:
            raise self._fail(key, f"= {value} is outside [{lo}, {hi}]")
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.config.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._fail(key, f"must be true or false, got {value!r}")
        return value

    def int_list(self, key: str, *, lo: int = 0, hi: int = MAX_DIM) -> list[int]:
        """A list of integers in [lo, hi]; absent or null is the empty list."""
        value = self.config.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or len(value) > MAX_LAYERS:
            raise self._fail(key, f"must be a list of at most {MAX_LAYERS} integers")
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int) or not lo <= item <= hi:
                raise self._fail(key, f"has entry {item!r}, not an integer in [{lo}, {hi}]")
        return list(value)

    def str_list(self, key: str, length: int, allowed: set[str]) -> list[str] | None:
        value = self.config.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or len(value) < length:
            raise self._fail(key, f"must be a list of at least {length} entries")
        for item in value[:length]:
            if item not in allowed:
                raise self._fail(key, f"has unknown entry {item!r} (allowed: {sorted(allowed)})")
        return list(value[:length])

    def rope(self) -> dict[str, Any]:
        """RoPE parameters from `rope_parameters` (transformers >= 5) or the legacy keys."""
        params = self.config.get("rope_parameters")
        if params is None:
            params = dict(self.config.get("rope_scaling") or {})
        if not isinstance(params, dict):
            raise self._fail("rope_parameters", "must be an object")
        params = dict(params)
        if "rope_theta" not in params and "rope_theta" in self.config:
            params["rope_theta"] = self.config["rope_theta"]
        if "partial_rotary_factor" not in params and "partial_rotary_factor" in self.config:
            params["partial_rotary_factor"] = self.config["partial_rotary_factor"]
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params["type"]
        return params


class Linear:
    """A resident weight [O, I] with an optional bias, computed by the backend's kernels."""

    def __init__(self, weight: QuantWeight, bias: np.ndarray | None, ops: Ops) -> None:
        self.weight = weight
        self.bias = bias
        self.ops = ops

    @classmethod
    def load(
        cls,
        src: WeightSource,
        ops: Ops,
        prefix: str,
        out_features: int,
        in_features: int,
        *,
        bias: bool = False,
    ) -> Linear:
        weight = src.weight(f"{prefix}.weight", (out_features, in_features))
        b = src.vector(f"{prefix}.bias", (out_features,)) if bias else None
        return cls(weight, b, ops)

    def __call__(self, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        y = self.ops.matmul(self.weight, x, family)  # [S, O]
        if self.bias is not None:
            y += self.bias
        return y


# ---- the model seam: what the engine asks of every architecture's model --------------
Lookahead = Callable[[np.ndarray], None]
"""Called with a layer's post-attention residual [S, D] (PILOT's guess of the next MoE
layer's experts, engine/pilot.py)."""


class NextMoE(Protocol):
    """A MoE layer as a lookahead sees it: its index, its router's k, and the experts its
    router ranks best for rows of the residual stream before it (norm and router only)."""

    @property
    def moe_layer(self) -> int: ...

    @property
    def top_k(self) -> int: ...

    def candidates(self, h: np.ndarray, n: int) -> np.ndarray:
        """The ``n`` best experts per row [S, n], best first."""
        ...


class DraftLayer(Protocol):
    """A model's multi-token-prediction layer (GLM-5, DeepSeek-V3): drafts tokens for
    speculative decoding from the main model's hidden states (engine/mtp_draft.py)."""

    def cache_layout(self) -> dict[str, tuple[int, ...]]: ...

    def draft_hidden(
        self,
        model: Model,
        next_tokens: np.ndarray,
        hidden: np.ndarray,
        positions: np.ndarray,
        cache: Any,
        family: KernelFamily,
    ) -> np.ndarray: ...


class Model(Protocol):
    """What the engine asks of a model (models.transformer.Transformer for every family):
    one forward pass over segments, the head, the KV layout, the MTP layer when the
    checkpoint has one and it was loaded (else None), and PILOT's lookahead hooks."""

    vocab: int
    mtp: DraftLayer | None

    def cache_layouts(self) -> list[dict[str, tuple[int, ...]]]: ...

    def hidden_states(self, tokens: np.ndarray, segments: Sequence[Segment]) -> np.ndarray: ...

    def logits(self, hidden: np.ndarray, family: KernelFamily) -> np.ndarray: ...

    def set_lookahead(self, make: Callable[[NextMoE], Lookahead]) -> int:
        """Give every layer followed by a MoE layer the lookahead ``make`` builds for that
        MoE layer; returns how many got one."""
        ...
