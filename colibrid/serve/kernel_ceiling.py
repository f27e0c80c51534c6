"""The kernel ceiling of the live roofline: how many tokens a second the CPU kernels could
compute for the loaded model if reading its weights cost nothing.

Why: on a few cores an int4 matrix in the F32 family can take longer to multiply than
to read, so a resident request can be bound by arithmetic rather than by the memory bus;
without this ceiling the roofline would call it memory-bound at a low share and hide the
real limit. It is ``colibri bench decode``'s kernel floor, made cheap enough to measure
beside the disk and memory probes (after a load and when idle, serve.roofline):

* the speed: each weight layout the model's matrices use (``Checkpoint.matrix_layouts``)
  is timed once at S = 1, on a random matrix of that layout small enough to stay in a
  core's cache (backends.kernel_speed, through the kernels' own dispatch, so at the ISA
  calibration chose for the layout), in the engine's kernel family; this is seconds per
  weight byte, the arithmetic alone;
* the work: the bytes of every matrix a token multiplies, by layout, from the matrices
  the model loaded (``Checkpoint.matrix_kinds``: attention, dense MLPs, shared experts,
  the head; the untied embedding table is a row lookup, and an idle MTP layer does not
  run) plus top-k routed experts in every MoE layer, each priced at its own layout. With
  a precision plan (``colibri requant --by-heat``) a layer's experts differ: a routed pick
  is priced at the mean over the main model's experts of each stored format, as if every
  expert were equally likely (the ceiling knows no workload's heat).

Only matrix products count (norms, attention over the cache and routing are left out),
as in the bench's floor. The kernels timed are the CPU backend's: on another backend the
ceiling is not measured (None).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from colibrid.backends.kernel_speed import Layout, layout_seconds_per_byte
from colibrid.store.experts import PROJECTIONS, expert_tensor_names
from colibrid.store.precision_plan import expert_formats

if TYPE_CHECKING:
    from colibrid.engine.engine import Engine


def token_bytes(engine: Engine) -> dict[Layout, float]:
    """The weight bytes one decode token multiplies, by layout."""
    from colibrid.engine.layout import mtp_prefix

    checkpoint = engine.checkpoint
    store = engine.experts.layout
    idle = mtp_prefix(engine.args, checkpoint)
    skip = expert_tensor_names(store)
    out: dict[Layout, float] = {}
    for name, (layout, nbytes) in list(checkpoint.matrix_kinds.items()):
        if name in skip or (idle and not engine.mtp_on and name.startswith(idle)):
            continue
        if name.endswith("embed_tokens.weight") and not engine.args.trunk.tie_word_embeddings:
            continue  # a row lookup, not a product
        out[layout] = out.get(layout, 0.0) + nbytes
    formats = expert_formats(checkpoint, store)  # header facts only
    if not formats:
        return out
    picks = engine.args.moe.num_experts_per_tok * len(store.profiled_layers)
    counts = Counter(formats.values())
    first = {}
    for key, label in formats.items():
        first.setdefault(label, key)
    for label, (layer, expert) in first.items():  # one expert of each stored format
        share = picks * counts[label] / len(formats)
        for proj in PROJECTIONS:
            w = checkpoint.weight(store.tensor_name(layer, expert, proj), store.shape(proj))
            out[w.layout] = out.get(w.layout, 0.0) + share * w.nbytes
    return out


def kernel_tok_s(engine: Engine) -> float | None:
    """The kernel-bound decode tok/s of one request alone; None off the CPU backend."""
    if engine.ops.name != "cpu":
        return None
    rows = engine.checkpoint.matrix_layouts
    seconds = sum(
        nbytes * layout_seconds_per_byte(layout, rows.get(layout, 1 << 20), engine.family)
        for layout, nbytes in token_bytes(engine).items()
    )
    return 1.0 / seconds if seconds > 0 else None
