"""The MLX backend: the model's ops computed by MLX (Apple silicon, or mlx[cpu] on Linux).

numpy arrays in and out at the seam, as every backend: models and the store never see
an mx array. Inside an op the arithmetic is one lazy MLX graph evaluated once (`_run`),
so a MoE layer's experts or an attention block cost one synchronisation, not one per
expert or per projection. Weights are converted once per weight object
(backends.mlx_weights) and kept in the device tier (backends.device_tier), which `ps`
shows as the vram row. Results equal the numpy reference to float tolerance (MLX sums
in its own order), which the whole-model oracle checks token for token.

Only the F32 kernel family is computed: I8 (int8 activations, bit-exact integer dot
products) is a CPU-kernel contract MLX has no matching arithmetic for, so it is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import mlx.core as mx
import numpy as np

from colibrid.backends.base import (
    DeviceTierStats,
    ExpertBatch,
    GQAWeights,
    KernelFamily,
    ResidentExperts,
    RouteRule,
    SwiGLUWeights,
    require_family,
)
from colibrid.backends.device_tier import DeviceTier
from colibrid.backends.mlx_weights import MlxWeight, convert
from colibrid.backends.moe_plan import moe_each
from colibrid.formats.quant import dequantize_rows
from colibrid.formats.weights import QuantWeight, WeightLayout

EXCLUDED = np.float32(-1e30)
"""What a key outside the causal mask scores (as models.layers.attention.EXCLUDED, which
the backends may not import): exp of it minus the row's maximum is exactly 0."""


def _family(family: KernelFamily) -> None:
    require_family(MlxOps.name, MlxOps.families, family)


def _in(a: np.ndarray) -> mx.array:
    return mx.array(np.ascontiguousarray(a, dtype=np.float32))


def _run(*outs: mx.array) -> list[np.ndarray]:
    """Evaluate the op's graph once and bring the results back as writable numpy arrays."""
    mx.eval(*outs)
    return [np.array(o, copy=True) for o in outs]


def _rms(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis, in float32."""
    variance = mx.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)
    return weight * (x * (1.0 / mx.sqrt(variance)))


def _rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """rotate_half RoPE (layers.rope.apply_half): x [S, H, d], cos/sin [S, half]."""
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return mx.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half :]], axis=-1)


def _attend(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    start: int,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Causal GQA attention (NumpyOps.attend_gqa's layout): q [S, H, d] at positions
    start.., keys/values [T, G, d]; returns [S, H * d]. Masked keys score EXCLUDED, as in
    layers.attention, so a fully visible row takes no special path; with a sliding
    window, row p sees keys t > p - window only (layers.attention.causal_mask)."""
    rows, heads, d = q.shape
    t, kv_heads = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    q_g = q.transpose(1, 0, 2).reshape(kv_heads, group * rows, d)
    scores = (q_g @ keys.transpose(1, 2, 0)) * np.float32(scale)
    scores = scores.reshape(heads, rows, t)
    key, position = mx.arange(t)[None, :], (start + mx.arange(rows))[:, None]
    visible = key <= position
    if window is not None:
        visible = mx.logical_and(visible, key > position - window)
    scores = mx.where(visible[None], scores, EXCLUDED)
    top = mx.max(scores, axis=-1, keepdims=True)
    if sinks is not None:  # one more logit per head, in the maximum and the sum only
        top = mx.maximum(top, sinks[:, None, None])
    probs = mx.exp(scores - top)
    total = mx.sum(probs, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + mx.exp(sinks[:, None, None] - top)
    probs = probs / total
    out = probs.reshape(kv_heads, group * rows, t) @ values.transpose(1, 0, 2)
    return out.reshape(heads, rows, d).transpose(1, 0, 2).reshape(rows, heads * d)


def _swiglu(gate: MlxWeight, up: MlxWeight, down: MlxWeight, x: mx.array) -> mx.array:
    g = gate.matmul(x)
    u = up.matmul(x)
    return down.matmul((g / (1.0 + mx.exp(-g))) * u)


class MlxOps:
    """Implements models.base.Ops on MLX; weights convert at their first use and stay
    converted in the device tier (backends.device_tier) for as long as the weight lives,
    within ``budget`` bytes when one is given."""

    name = "mlx"
    families = frozenset({KernelFamily.F32})

    def __init__(self, budget: int | None = None) -> None:
        self.tier: DeviceTier[MlxWeight] = DeviceTier(convert, lambda m: m.nbytes, budget)
        self.tier.stats.device = f"MLX ({mx.default_device().type.name})"

    def _w(self, w: QuantWeight, expert: bool = False) -> MlxWeight:
        return self.tier.get(w, expert)

    def _trio(self, weights: SwiGLUWeights, expert: bool) -> tuple[MlxWeight, ...]:
        return tuple(self._w(w, expert) for w in (weights.gate, weights.up, weights.down))

    def prepare(self, layouts: Mapping[WeightLayout, int]) -> None:
        """Nothing to tune: MLX picks its own kernels."""

    def matmul(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        _family(family)
        return _run(self._w(w).matmul(_in(x)))[0]

    def matmul_many(
        self, weights: Sequence[QuantWeight], x: np.ndarray, family: KernelFamily
    ) -> list[np.ndarray]:
        _family(family)
        xs = _in(x)
        return _run(*(self._w(w).matmul(xs) for w in weights))

    def matmul_blocks(self, w: QuantWeight, x: np.ndarray, family: KernelFamily) -> np.ndarray:
        _family(family)
        xs = _in(x)
        blocks = xs.shape[-2]
        width = w.shape[0] // blocks
        if width * blocks != w.shape[0]:
            raise ValueError(f"{w.shape[0]} output rows do not split into {blocks} equal blocks")
        mw = self._w(w)
        parts = [mw.rows(b * width, (b + 1) * width).matmul(xs[..., b, :]) for b in range(blocks)]
        return _run(mx.concatenate(parts, axis=-1))[0]

    def expert_swiglu(
        self,
        gate: QuantWeight,
        up: QuantWeight,
        down: QuantWeight,
        x: np.ndarray,
        family: KernelFamily,
    ) -> np.ndarray:
        _family(family)
        return _run(_swiglu(self._w(gate), self._w(up), self._w(down), _in(x)))[0]

    def apply_experts(
        self, batch: ExpertBatch, x: np.ndarray, out: np.ndarray, family: KernelFamily
    ) -> None:
        """Every expert's rows in one graph, one evaluation, then one scatter into out."""
        _family(family)
        xs = _in(x)
        parts: list[mx.array] = []
        for e, w in enumerate(batch.weights):
            lo, hi = batch.start[e], batch.start[e + 1]
            if lo == hi:
                continue
            rows = xs[mx.array(batch.rows[lo:hi])]
            gates = mx.array(np.asarray(batch.gates[lo:hi], dtype=np.float32))[:, None]
            parts.append(_swiglu(*self._trio(w, expert=True), rows) * gates)
        if not parts:
            return
        (ys,) = _run(mx.concatenate(parts, axis=0))
        out[np.asarray(batch.dest, dtype=np.int64)] = ys

    def rank_sum(self, parts: np.ndarray) -> np.ndarray:
        p = _in(parts)
        total = mx.zeros((p.shape[0], p.shape[2]), dtype=mx.float32)
        for r in range(p.shape[1]):
            total = total + p[:, r]
        return _run(total)[0]

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
        """The layer from this backend's route, apply_experts and rank_sum (moe_each)."""
        return moe_each(self, x, weight, bias, rule, layer, shared, family)

    def route(
        self, h: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, rule: RouteRule, n: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """layers.router.route_reference in MLX; argsort of MLX is stable, so ties go to the
        lowest expert index as the rule says."""
        logits = _in(h) @ _in(weight).T  # [S, E]
        if rule.softmax:  # over all experts, before the top-k
            shifted = mx.exp(logits - mx.max(logits, axis=1, keepdims=True))
            scores = shifted / mx.sum(shifted, axis=1, keepdims=True)
        else:
            scores = mx.sigmoid(logits)
        choice = scores + _in(bias) if bias is not None else scores
        if rule.n_group > 1 and rule.topk_group < rule.n_group:
            rows = choice.shape[0]
            grouped = choice.reshape(rows, rule.n_group, -1)
            best_two = mx.sort(grouped, axis=-1)[..., -2:]
            group_scores = best_two[..., 1] + best_two[..., 0]
            keep = mx.argsort(-group_scores, axis=1)[:, : rule.topk_group]  # [S, k]
            mask = mx.any(mx.arange(rule.n_group)[None, None, :] == keep[:, :, None], axis=1)
            choice = mx.where(mask[:, :, None], grouped, -np.inf).reshape(rows, -1)
        experts = mx.argsort(-choice, axis=1)[:, :n].astype(mx.int64)
        gates = mx.take_along_axis(scores, experts[:, : rule.top_k], axis=1)
        if rule.norm:
            gates = gates / (mx.sum(gates, axis=1, keepdims=True) + np.float32(1e-20))
        ids, g = _run(experts, gates * np.float32(rule.scaling))
        return ids, g

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
        """backends.gqa_plan.gqa_attention_each as one graph: the new keys and values join the
        cached ones inside it and are written back to the numpy caches afterwards."""
        _family(family)
        keys, values = caches
        rows, kv_heads, d = x.shape[0], keys.shape[1], keys.shape[2]
        xs = _in(x)
        q, k, v = (self._w(w).matmul(xs) for w in (block.q, block.k, block.v))
        if block.biases is not None:
            q, k, v = (y + _in(b) for y, b in zip((q, k, v), block.biases, strict=True))
        if block.qk_norm is not None and block.qk_norm_whole:  # each row's whole projection
            q = _rms(q, _in(block.qk_norm[0]), block.eps)
            k = _rms(k, _in(block.qk_norm[1]), block.eps)
        q = q.reshape(rows, -1, d)
        k = k.reshape(rows, kv_heads, d)
        v = v.reshape(rows, kv_heads, d)
        if block.qk_norm is not None and not block.qk_norm_whole:  # each head
            q = _rms(q, _in(block.qk_norm[0]), block.eps)
            k = _rms(k, _in(block.qk_norm[1]), block.eps)
        cos, sin = _in(rope[0]), _in(rope[1])
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        all_k = mx.concatenate([_in(keys[:start]), k]) if start else k
        all_v = mx.concatenate([_in(values[:start]), v]) if start else v
        sinks = None if block.sinks is None else _in(block.sinks)
        out = self._w(block.o).matmul(_attend(q, all_k, all_v, scale, start, block.window, sinks))
        y, new_k, new_v = _run(out, k, v)
        keys[start : start + rows] = new_k
        values[start : start + rows] = new_v
        return y

    def rope_half(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        return _run(_rope(_in(x), _in(cos), _in(sin)))[0]

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        return _run(_rms(_in(x), _in(weight), eps))[0]

    def add_rms_norm(
        self, h: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float
    ) -> tuple[np.ndarray, np.ndarray]:
        total = _in(h) + _in(delta)
        t, n = _run(total, _rms(total, _in(weight), eps))
        return t, n

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
        s = None if sinks is None else _in(sinks)
        return _run(_attend(_in(q), _in(keys), _in(values), scale, start, window, s))[0]

    def embed(self, table: QuantWeight, ids: np.ndarray) -> np.ndarray:
        """A row lookup, no arithmetic worth a device: done on the host."""
        return dequantize_rows(table, np.asarray(ids, dtype=np.int64))

    def device_tier(self) -> DeviceTierStats | None:
        """The MLX arrays the weights became (on Apple silicon, wired unified memory)."""
        return dataclasses.replace(self.tier.stats)

    def promote(self, experts: Sequence[SwiGLUWeights]) -> int:
        return self.tier.promote([m for e in experts for m in (e.gate, e.up, e.down)])
