"""The GGUF tensors of a colibri model: names, types and sizes up front, bytes on demand.

Why planned before written: a GGUF file (and each shard of a split one) begins with every
tensor's name, shape, type and offset, so all of them must be known before the first data
byte, while the data itself (a layer's experts can be a gigabyte) is produced only when it
is written. What the model holds comes from the model code itself
(:func:`colibrid.engine.validate.validate`: every tensor a family's loader asks for, with
its logical shape), so a tensor the model does not use is never exported and one it needs
is never missed. The experts of a layer are stacked into one 3-D tensor a projection.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from colibrid.convert.gguf_arch import EXPERT, Family, Names, layer_of
from colibrid.convert.gguf_blocks import Encoding, choose, encode
from colibrid.engine.validate import Expected
from colibrid.errors import ConvertError
from colibrid.formats.weights import QuantWeight
from colibrid.store.checkpoint import Checkpoint

GATE_UP_BIAS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.gate_up_proj_bias$")
MLA_FAMILIES = ("deepseek_v3", "glm_moe_dsa", "deepseek_v32")


@dataclass(frozen=True)
class Planned:
    """One GGUF tensor: its name, the numpy shape of its data (elements for F32, bytes for
    block types), its GGUF type, and how to make the data when it is written."""

    name: str
    shape: tuple[int, ...]
    ggml: str
    make: Callable[[], np.ndarray]
    note: str | None = None  # why a quantised tensor fell back to f32

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * (4 if self.ggml == "F32" else 1)


def _data_shape(ggml: str, rows: tuple[int, ...], cols: int) -> tuple[int, ...]:
    import gguf

    if ggml == "F32":
        return (*rows, cols)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml]]
    return (*rows, cols // block * size)


def _as_bytes(a: np.ndarray, ggml: str) -> np.ndarray:
    if ggml == "F32":
        return np.ascontiguousarray(a, dtype=np.float32)
    return np.ascontiguousarray(a).view(np.uint8)


def _vector(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    return lambda: np.ascontiguousarray(ckpt.vector(name, shape), dtype=np.float32)


def _f32(values: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
    return lambda: np.ascontiguousarray(values(), dtype=np.float32)


class Planner:
    """Plans the tensors of one open checkpoint for one family."""

    def __init__(self, ckpt: Checkpoint, fam: Family, cfg: dict) -> None:
        self.ckpt, self.fam, self.cfg = ckpt, fam, cfg
        self.n_layers = int(cfg["num_hidden_layers"])
        self.names = Names(fam, self.n_layers)

    def plan(self, expected: dict[str, Expected]) -> list[Planned]:
        groups: dict[str, list[tuple[int, str, tuple[int, int]]]] = {}
        order: list[str] = []
        for name, exp in expected.items():
            layer = layer_of(name)
            if layer is not None and layer >= self.n_layers:
                continue  # MTP layers: not part of llama.cpp's graph of these models
            m = EXPERT.match(name)
            if m:
                key = f"{m.group(1)}.{m.group(4)}.weight"
                if key not in groups:
                    groups[key] = []
                    order.append(key)
                groups[key].append((int(m.group(3)), name, exp.shape))  # type: ignore[arg-type]
            else:
                order.append(name)
        out: list[Planned] = []
        for name in order:
            if name in groups:
                out.append(self._experts(name, sorted(groups[name])))
            else:
                out.extend(self._one(expected[name]))
        return out

    # ---- single tensors -----------------------------------------------------------

    def _one(self, exp: Expected) -> Iterator[Planned]:
        name, shape = exp.name, tuple(exp.shape)
        m = GATE_UP_BIAS.match(name)
        if m:  # gpt-oss: gate at even, up at odd columns
            fused = _vector(self.ckpt, name, shape)
            for proj, cols in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                half = (shape[0], shape[1] // 2)
                yield Planned(
                    self.names(f"{m.group(1)}.{proj}.bias"),
                    half,
                    "F32",
                    _f32(lambda cols=cols: fused()[:, cols]),
                )
            return
        if name.endswith("experts.down_proj_bias"):
            gguf_name = self.names(name.replace("down_proj_bias", "down_proj.bias"))
            yield Planned(gguf_name, shape, "F32", _vector(self.ckpt, name, shape))
            return
        if exp.kind == "vector":
            yield Planned(self.names(name), shape, "F32", _vector(self.ckpt, name, shape))
            return
        if name.endswith("kv_b_proj.weight") and self.fam.model_type in MLA_FAMILIES:
            yield from self._kv_b(name, shape)  # type: ignore[arg-type]
            return
        yield self._matrix(name, shape)  # type: ignore[arg-type]

    def _weight(self, name: str, shape: tuple[int, int]) -> QuantWeight:
        w = self.ckpt.weight(name, shape)
        if self.fam.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _rows(w, _halves_to_pairs(shape[0], self._head_dim()))
        return w

    def _head_dim(self) -> int:
        cfg = self.cfg
        return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])

    def _matrix(self, name: str, shape: tuple[int, int]) -> Planned:
        enc = choose([self._weight(name, shape)])
        return Planned(
            self.names(name),
            _data_shape(enc.ggml, (shape[0],), shape[1]),
            enc.ggml,
            lambda: _as_bytes(encode(self._weight(name, shape), enc.ggml), enc.ggml),
            _note(name, enc),
        )

    def _kv_b(self, name: str, shape: tuple[int, int]) -> Iterator[Planned]:
        """MLA's kv_b [H * (nope + v), kv_lora] as llama.cpp's k_b [H, kv_lora, nope]
        (transposed per head) and v_b [H, v, kv_lora], in f32 (exact)."""
        cfg = self.cfg
        heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        rank = shape[1]
        if shape[0] != heads * (nope + v):
            raise ConvertError(f"{name}: {shape} is not {heads} heads of {nope} + {v} rows")

        def per_head() -> np.ndarray:
            return encode(self.ckpt.weight(name, shape), "F32").reshape(heads, nope + v, rank)

        k_name = self.names(name.replace("kv_b_proj", "k_b_proj"))
        v_name = self.names(name.replace("kv_b_proj", "v_b_proj"))
        yield Planned(
            k_name,
            (heads, rank, nope),
            "F32",
            _f32(lambda: per_head()[:, :nope, :].transpose(0, 2, 1)),
        )
        yield Planned(v_name, (heads, v, rank), "F32", _f32(lambda: per_head()[:, nope:, :]))

    # ---- a layer's experts, stacked ------------------------------------------------

    def _experts(self, key: str, members: list[tuple[int, str, tuple[int, int]]]) -> Planned:
        expected = list(range(len(members)))
        if [e for e, _, _ in members] != expected:
            raise ConvertError(f"{key}: experts are not numbered 0..{len(members) - 1}")
        shape = members[0][2]
        enc = choose(self.ckpt.weight(n, s) for _, n, s in members)

        def make() -> np.ndarray:
            parts = [
                _as_bytes(encode(self.ckpt.weight(n, s), enc.ggml), enc.ggml) for _, n, s in members
            ]
            return np.stack(parts)

        return Planned(
            self.names(key),
            _data_shape(enc.ggml, (len(members), shape[0]), shape[1]),
            enc.ggml,
            make,
            _note(key, enc),
        )


def _note(name: str, enc: Encoding) -> str | None:
    return None if enc.fallback is None else f"{name}: written as f32 ({enc.fallback})"


def _halves_to_pairs(rows: int, head_dim: int) -> np.ndarray:
    """The row order that turns each head's rotate-half layout (first half, second half)
    into interleaved pairs (0, half, 1, half + 1, ...): llama.cpp's rotation of llama."""
    half = head_dim // 2
    within = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return (np.arange(rows // head_dim)[:, None] * head_dim + within[None, :]).reshape(-1)


def _rows(w: QuantWeight, order: np.ndarray) -> QuantWeight:
    scales = None if w.scales is None else np.ascontiguousarray(np.asarray(w.scales)[order])
    return dataclasses.replace(
        w, data=np.ascontiguousarray(np.asarray(w.data)[order]), scales=scales
    )
