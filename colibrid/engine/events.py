"""What a generation emits: a TokenEvent per generated token, then one DoneEvent with the
finish reason and the statistics (`GenStats`). Every driver (the one-shot CLI, the daemon's
batcher) hands these to its front end, which decides itself how to print or frame text."""

from __future__ import annotations

from dataclasses import dataclass

from colibrid.engine.constraint import ConstraintStats
from colibrid.engine.logprobs import TokenLogprobs
from colibrid.engine.speculate import SpecStats


@dataclass(frozen=True)
class GenStats:
    """Counts and timings of one generation.

    generated_tokens counts every sampled token, a stop token included. The first token
    comes from the prefill logits, so decode_tok_s is over generated_tokens - 1 steps.
    prefill_tok_s is over the prompt tokens actually computed (not those reused from kept
    KV), 0.0 when none were.
    """

    prompt_tokens: int
    generated_tokens: int
    prefill_s: float
    decode_s: float
    prefill_tok_s: float
    decode_tok_s: float

    @classmethod
    def measure(
        cls,
        prompt: int,
        generated: int,
        prefill_s: float,
        decode_s: float,
        computed: int | None = None,
    ) -> GenStats:
        steps = max(generated - 1, 0)
        computed = prompt if computed is None else computed
        return cls(
            prompt_tokens=prompt,
            generated_tokens=generated,
            prefill_s=prefill_s,
            decode_s=decode_s,
            prefill_tok_s=computed / prefill_s if computed and prefill_s > 0 else 0.0,
            decode_tok_s=steps / decode_s if decode_s > 0 else 0.0,
        )

    def as_line(self, *, verbose: bool = False) -> str:
        line = (
            f"{self.prompt_tokens} prompt + {self.generated_tokens} generated tokens, "
            f"prefill {self.prefill_tok_s:.1f} tok/s, decode {self.decode_tok_s:.1f} tok/s"
        )
        if verbose:
            line += f" (prefill {self.prefill_s:.3f} s, decode {self.decode_s:.3f} s)"
        return line


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it releases ("" while text is held back), and
    its logprobs when the request asked for them."""

    token_id: int
    text: str
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class DoneEvent:
    """The end: finish_reason is "stop", "length" or "cancelled". With a grammar,
    "stop" means the grammar accepts the text; "length" means it was cut short."""

    finish_reason: str
    stats: GenStats
    stop_string: str | None = None  # the stop string that ended the answer, if one did
    spec: SpecStats | None = None  # what speculation did, when it was on
    constraint: ConstraintStats | None = None  # what the grammar's masks cost, when one ran


GenEvent = TokenEvent | DoneEvent
