"""Check a container against its config before any weight byte is mapped or read.

Why: a container comes from an untrusted mirror or an interrupted job. The safetensors
reader already proves every file is self-consistent (offsets inside the file, no
overlaps); this module proves the files are the model config.json describes: every
tensor the model will load exists with the shape the config implies, in a format whose
byte sizes match, with its ``.qs`` scales present. The first problem ends the check with
one line naming the tensor.

The expected tensors come from the model code itself, not a second copy of the config
rules: the family's ``build`` runs against a recording weight source that answers with
zero-cost broadcast placeholders and notes every (name, shape, kind) it is asked for.

It lives in the engine because it joins the three parts the engine composes (the model
code, the expert layout, the store's checkpoint); the engine runs it before every load and
the converter imports it from here, so the engine never imports the converter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from colibrid.errors import CheckpointError
from colibrid.formats.weights import QuantWeight, WeightFormat
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.strict_json import describe


@dataclass(frozen=True)
class Expected:
    name: str
    shape: tuple[int, ...]
    kind: str  # "matrix" (any weight format) or "vector" (float only)


class _Recorder:
    """A WeightSource that records requests and returns free placeholders."""

    def __init__(self, has: Callable[[str], bool]) -> None:
        self.has = has
        self.seen: dict[str, Expected] = {}

    def _note(self, name: str, shape: tuple[int, ...], kind: str) -> None:
        self.seen.setdefault(name, Expected(name, tuple(shape), kind))

    def weight(self, name: str, shape: tuple[int, int]) -> QuantWeight:
        self._note(name, shape, "matrix")
        return QuantWeight(WeightFormat.F32, tuple(shape), np.broadcast_to(np.float32(0), shape))

    def vector(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        self._note(name, shape, "vector")
        return np.broadcast_to(np.float32(0), shape)

    def dense_f32(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        self._note(name, shape, "matrix")
        return np.zeros(shape, dtype=np.float32)


class _NoExperts:
    def iter_groups(self, layer: int, experts: Any) -> Any:
        return iter(())

    def record(self, layer: int, experts: Any) -> None:
        return None

    def resident(self, layer: int) -> Any:
        return None


class Validated(NamedTuple):
    """What `validate` found: the config's arguments, every tensor expected and its stored
    format, and the KV bytes one position of context costs (from the same model walk)."""

    args: Any
    expected: dict[str, Expected]
    formats: dict[str, str]
    kv_per_position: int


def expected_from_config(
    config: dict[str, Any], has: Callable[[str], bool]
) -> tuple[Any, dict[str, Expected]]:
    """(ModelArgs, every tensor the model and its expert store will load); ``has``
    answers the model's questions about optional tensors (biases, MTP, tied head)."""
    args, seen, _ = _expected_and_kv(config, has)
    return args, seen


def _expected_and_kv(
    config: dict[str, Any], has: Callable[[str], bool]
) -> tuple[Any, dict[str, Expected], int]:
    """`expected_from_config` plus the KV bytes per position, from one model walk."""
    from colibrid.engine.layout import expert_layout
    from colibrid.models import family
    from colibrid.store.experts import PROJECTIONS

    model_type = config.get("model_type")
    module = family(model_type)
    args = module.ModelArgs.from_config(config)
    rec = _Recorder(has)
    kv = _walk_model(args, rec, model_type)
    layout = expert_layout(args, rec, with_mtp=True)
    for layer in layout.moe_layers:
        for e in range(layout.n_experts):
            for proj in PROJECTIONS:
                rec._note(layout.tensor_name(layer, e, proj), layout.shape(proj), "matrix")
    return args, rec.seen, kv


def _walk_model(args: Any, rec: _Recorder, model_type: object) -> int:
    """Run the family's loaders one layer at a time, dropping each layer at once, so a
    78-layer model is walked in one layer's worth of placeholder memory. This is the
    loop of the families' ``build`` (all share load_decoder_layer / attention_at).
    Returns the KV bytes per position of the layers walked."""
    from colibrid.engine.kv import bytes_per_position
    from colibrid.models import mtp_loader
    from colibrid.models.transformer import Transformer, load_decoder_layer

    t, experts = args.trunk, _NoExperts()
    kv = 0
    for layer in range(t.num_hidden_layers):
        decoder = load_decoder_layer(
            rec,
            None,
            experts,
            layer,
            args.attention_at(rec, None, layer),
            hidden=t.hidden_size,
            eps=t.rms_norm_eps,
            moe=args.moe if args.is_moe[layer] else None,
            dense_width=t.intermediate_size,
        )
        kv += bytes_per_position([decoder.attention.cache_layout()])
    Transformer(
        rec,
        None,
        vocab=t.vocab_size,
        hidden=t.hidden_size,
        eps=t.rms_norm_eps,
        layers=[],
        rotary=None,
        tie_embeddings=t.tie_word_embeddings,
    )
    load_mtp = mtp_loader(model_type)
    if load_mtp is not None:
        load_mtp(args, rec, experts, None)
    return kv


def expected_tensors(ckpt: Checkpoint) -> tuple[Any, dict[str, Expected]]:
    return expected_from_config(ckpt.config, ckpt.has)


def tensor_format(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> str:
    """The stored format of ``name`` (f32/bf16/f16/fp8/int8-row/int4-row/int4-grouped/
    fp4-e2m1-g32),
    from header sizes only; raises CheckpointError naming the tensor on a mismatch."""
    info = ckpt.info(name)

    def where() -> str:  # only for an error line: a load checks ~10^5 tensors
        return f"{ckpt.file_of(name)}: tensor {describe(name)}"

    if info.dtype == "U8":
        if len(shape) != 2:
            raise CheckpointError(f"{where()}: U8 data for a {len(shape)}-D tensor")
        if not ckpt.has(name + ".qs"):
            raise CheckpointError(f"{where()}: U8 matrix without its .qs scales")
        fmt = ckpt.container_format(name, (shape[0], shape[1]))
        if fmt.name == "int4-grouped":
            return f"int4-g{fmt.group_size}"
        if fmt.name == "int4-row":
            hint = ckpt.group_size_hint(name)
            if hint and -(-shape[1] // hint) == 1:
                return f"int4-g{hint}"  # one group spans the row: same bytes as per-row
        return fmt.name
    if info.dtype == "F8_E4M3":
        if not ckpt.has(name + "_scale_inv"):
            raise CheckpointError(f"{where()}: FP8 weight without {name}_scale_inv")
    elif info.dtype not in ("F32", "BF16", "F16"):
        raise CheckpointError(f"{where()}: dtype {info.dtype} is not a weight format")
    if info.shape != tuple(shape):
        raise CheckpointError(
            f"{where()}: shape {list(info.shape)} but expected {list(shape)} from config"
        )
    return {"F8_E4M3": "fp8"}.get(info.dtype, info.dtype.lower())


def stored_bytes(ckpt: Checkpoint, name: str) -> int:
    n = ckpt.info(name).nbytes
    for extra in (".qs", "_scale_inv"):
        if ckpt.has(name + extra):
            n += ckpt.info(name + extra).nbytes
    return n


def _fused_hint(ckpt: Checkpoint, name: str) -> str:
    """Why a per-expert matrix may be missing: the folder keeps the experts fused, as
    transformers and OpenAI store gpt-oss (the store reads experts one by one)."""
    prefix, sep, _ = name.partition(".experts.")
    fused = (f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.gate_up_proj_blocks")
    if sep and any(ckpt.has(f) for f in fused):
        return " (the experts are fused, as transformers stores them: run colibri convert first)"
    return ""


def validate(ckpt: Checkpoint) -> Validated:
    """Validate every expected tensor; returns args, expected, name -> format and the KV
    bytes per position."""
    args, expected, kv = _expected_and_kv(ckpt.config, ckpt.has)
    formats: dict[str, str] = {}
    for exp in expected.values():
        if not ckpt.has(exp.name):
            raise CheckpointError(
                f"{ckpt.dir}: tensor {describe(exp.name)} is missing{_fused_hint(ckpt, exp.name)}"
            )
        fmt = tensor_format(ckpt, exp.name, exp.shape)
        if exp.kind == "vector" and fmt not in ("f32", "bf16", "f16"):
            raise CheckpointError(
                f"{ckpt.file_of(exp.name).name}: tensor "
                f"{describe(exp.name)}: {fmt} where a float tensor is needed"
            )
        formats[exp.name] = fmt
    return Validated(args, expected, formats, kv)
