"""gpt-oss's fused expert tensors as the per-expert matrices colibri stores.

transformers (and OpenAI's checkpoints) keep a layer's experts in two fused tensors:
``mlp.experts.gate_up_proj`` [E, D, 2F] (x @ W, gate at even and up at odd output
columns) and ``mlp.experts.down_proj`` [E, F, D]. The expert store reads each expert as
three contiguous [O, I] matrices (``mlp.experts.E.{gate,up,down}_proj.weight``), so the
conversion transposes and de-interleaves them; the expert biases stay fused (resident,
de-interleaved at load).

Why here: the converter and the oracle's checkpoint builder must split the same way.
"""

from __future__ import annotations

import re

import numpy as np

FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def is_fused(name: str) -> bool:
    return FUSED.match(name) is not None


def split_names(name: str, n_experts: int) -> list[str]:
    """The per-expert matrix names one fused tensor becomes, expert by expert."""
    m = FUSED.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a fused gpt-oss expert tensor")
    projs = ("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else ("down_proj",)
    return [f"{m.group(1)}.{e}.{p}.weight" for e in range(n_experts) for p in projs]


def split_expert(name: str, fused_e: np.ndarray) -> list[np.ndarray]:
    """One expert's slice of a fused tensor ([D, 2F] or [F, D]) as its [O, I] matrices
    (views): gate [F, D] and up [F, D], or down [D, F]."""
    if FUSED.match(name).group(2) == "gate_up_proj":  # type: ignore[union-attr]
        return [fused_e[:, 0::2].T, fused_e[:, 1::2].T]
    return [fused_e.T]


def split_fused(name: str, fused: np.ndarray) -> dict[str, np.ndarray]:
    """Every per-expert matrix of a fused tensor [E, ...], C-contiguous."""
    names = iter(split_names(name, fused.shape[0]))
    return {
        next(names): np.ascontiguousarray(m)
        for e in range(fused.shape[0])
        for m in split_expert(name, fused[e])
    }
