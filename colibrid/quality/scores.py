"""How far a model's next-token distributions are from a reference's, position by position.

Why these three numbers: mean KL(REF ‖ MODEL) sees every probability a lower precision
moved, including the ones greedy decoding never shows; top-1 agreement is what a greedy
user sees change; perplexity on the same tokens puts both on the scale papers quote.
Everything is computed in float64 from the float32 logits, so the scores of two runs on
the same logits are the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from colibrid.engine.logprobs import log_softmax


@dataclass
class Scores:
    """Running sums over scored positions (`add`), reported as means (`summary`)."""

    positions: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    agree: int = 0
    nll_model: float = 0.0
    nll_ref: float = 0.0
    per_sequence_kl: list[float] = field(default_factory=list)

    def add(self, ref_logits: np.ndarray, model_logits: np.ndarray, targets: np.ndarray) -> None:
        """Score rows of logits [N, V] (both models, the same positions) predicting
        ``targets`` [N] (the tokens that follow in the sequence)."""
        if ref_logits.shape != model_logits.shape:
            raise ValueError(
                f"logits of different shapes: reference {ref_logits.shape}, "
                f"model {model_logits.shape} (not the same vocabulary?)"
            )
        lp_ref, lp_model = log_softmax(ref_logits), log_softmax(model_logits)
        kl = (np.exp(lp_ref) * (lp_ref - lp_model)).sum(axis=-1)
        kl = np.maximum(kl, 0.0)  # rounding can leave -1e-17 where the rows are equal
        rows = np.arange(len(targets))
        self.positions += len(targets)
        self.kl_sum += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max(initial=0.0)))
        self.agree += int((lp_ref.argmax(axis=-1) == lp_model.argmax(axis=-1)).sum())
        self.nll_model -= float(lp_model[rows, targets].sum())
        self.nll_ref -= float(lp_ref[rows, targets].sum())
        self.per_sequence_kl.append(float(kl.mean()) if len(kl) else 0.0)

    def summary(self) -> dict[str, float | int]:
        n = max(1, self.positions)
        return {
            "positions": self.positions,
            "kl_mean": self.kl_sum / n,
            "kl_max": self.kl_max,
            "top1_agreement": self.agree / n,
            "ppl_model": float(np.exp(self.nll_model / n)),
            "ppl_ref": float(np.exp(self.nll_ref / n)),
        }
