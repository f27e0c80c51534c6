"""Constrained decoding: a grammar (JSON schema, Lark, regex) as a mask on the logits.

A request may carry a `Grammar`; its generation then owns a `Constraint`, an llguidance
matcher fed every token the request samples. Before each token is sampled, the tokens
the grammar forbids next get -inf (greedy and sampled decoding alike, so the seeded
sampler draws from the allowed tokens only); the model's stop tokens are allowed only
where the grammar accepts the text so far; once nothing but a stop token could follow
(the JSON object is closed), the answer ends there with finish "stop". An answer the
grammar could not finish within `max_tokens` ends with "length", never as a success.

Why llguidance (not xgrammar, also on the registry): it needs no torch at run time (a
Rust wheel; the masks are plain bits that numpy applies), it takes JSON schema, Lark (with
`%json{...}` inside, which forced tool calls use) and regex through one API, and it
validates a grammar without a tokenizer, so a bad schema is refused at the edge before
the engine sees the request. Its mask cost per token is the DONE line's `mask_us`
(README, "Structured output", has figures).

`colibrid.engine.grammar` has the request's `Grammar` and its compiled form;
`Vocabulary` is the model's tokenizer as llguidance sees it (built once per model);
`Constraint` is one request's matcher and its cost. Every call into llguidance here is
inside `contain_panics`: a Rust panic fails the request that met it, nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np

from colibrid.engine.grammar import CompiledGrammar, llg_tokenizer, parser_limits, public_message
from colibrid.errors import ColibriError, RequestError, contain_panics


class ConstraintError(ColibriError):
    """The grammar and the model's vocabulary disagree mid-answer (a token the mask
    allowed was refused, or no token is allowed): that request fails, no other."""

    code = "BAD_REQUEST"


@dataclass(frozen=True)
class ConstraintStats:
    """What a request's constraint did and cost: `tokens` masked, `seconds` spent on
    masks and on feeding the matcher (per token: `mask_us`)."""

    kind: str
    tokens: int
    seconds: float

    @property
    def mask_us(self) -> float:
        return 1e6 * self.seconds / self.tokens if self.tokens else 0.0

    def extras(self) -> dict[str, str]:
        """The DONE line's `grammar=` and `mask_us=`."""
        return {"grammar": self.kind, "mask_us": f"{self.mask_us:.1f}"}


class Constraint:
    """One request's grammar state: `apply` masks a row of logits, `advance` feeds the
    sampled token, `complete` says nothing but a stop token may follow. Rows are masked
    in the order they are sampled, each after the tokens before it were fed, which is
    what keeps speculative decoding lossless: a verified row is masked with the state
    plain decoding would have had (`drafts` drops drafts the grammar refuses anyway)."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        kind: str,
        *,
        fast_forward: bool = True,
        owner: int = 0,
    ) -> None:
        self._matcher = matcher
        self.owner = owner
        self._n = vocab_size
        self._bits = np.full((vocab_size + 31) // 32, -1, dtype="<i4")
        self.kind = kind
        self.fast_forward = fast_forward
        self.tokens = 0
        self.seconds = 0.0

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """`logits` with every token the grammar forbids next at -inf (a new array)."""
        t0 = time.perf_counter()
        with contain_panics(f"the {self.kind} grammar's mask"):
            self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self._n)
        allowed = allowed.view(bool)
        row = np.asarray(logits)
        if row.shape != (self._n,):
            raise ConstraintError(f"logits of shape {row.shape} for a vocabulary of {self._n}")
        out = np.where(allowed, row, np.array(-np.inf, dtype=row.dtype))
        if not allowed.any():
            raise ConstraintError(f"the {self.kind} grammar allows no token here")
        self.seconds += time.perf_counter() - t0
        return out

    def advance(self, token: int) -> None:
        t0 = time.perf_counter()
        with contain_panics(f"the {self.kind} grammar"):
            ok = self._matcher.consume_token(int(token))
        self.seconds += time.perf_counter() - t0
        self.tokens += 1
        if not ok:
            self._check()
            raise ConstraintError(f"token {token} does not fit the {self.kind} grammar")

    @property
    def complete(self) -> bool:
        """Nothing but a stop token may follow: the answer is whole."""
        with contain_panics(f"the {self.kind} grammar"):
            return self._matcher.is_stopped() and not self._matcher.is_error()

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (none unless `fast_forward`):
        drafts the next pass verifies with the model, so that the fixed text of a JSON
        object costs one pass, not one a token."""
        if not self.fast_forward or limit <= 0:
            return []
        t0 = time.perf_counter()
        with contain_panics(f"the {self.kind} grammar"):
            tokens = self._matcher.compute_ff_tokens()[:limit]
        self.seconds += time.perf_counter() - t0
        return [int(t) for t in tokens]

    def drafts(self, tokens: Sequence[int]) -> list[int]:
        """The leading `tokens` the grammar accepts from here (speculative drafts past
        the first refused one could never be kept)."""
        if not tokens:
            return []
        with contain_panics(f"the {self.kind} grammar"):
            fit = self._matcher.validate_tokens([int(t) for t in tokens])
        return list(tokens[:fit])

    def stats(self) -> ConstraintStats:
        return ConstraintStats(self.kind, self.tokens, self.seconds)

    def _check(self) -> None:
        with contain_panics(f"the {self.kind} grammar"):
            problem = self._matcher.get_error() if self._matcher.is_error() else None
        if problem is not None:
            raise ConstraintError(f"the {self.kind} grammar failed: {public_message(problem)}")


class Vocabulary:
    """The model's tokenizer as llguidance needs it, to know each token's bytes: built
    from the serialized `tokenizers` tokenizer (a fraction of a second for 49k tokens;
    the daemon builds it once per loaded model, on its first constrained request).
    `vocab_size` is the model's logits size (it may exceed the tokenizer's: those ids are
    never allowed); `stop_ids` are the tokens that end an answer, allowed only where the
    grammar accepts. `owner` names the model it was built for (the engine host refuses a
    constraint built for another)."""

    def __init__(
        self, tokenizer_json: str, vocab_size: int, stop_ids: frozenset[int], owner: int = 0
    ) -> None:
        self._tok = llg_tokenizer(tokenizer_json, vocab_size, stop_ids)
        self.vocab_size = vocab_size
        self.owner = owner

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        return self._tok

    def constraint(self, grammar: CompiledGrammar, *, fast_forward: bool = True) -> Constraint:
        """A fresh matcher for `grammar` (RequestError when it does not fit this model's
        tokens, e.g. a special token the tokenizer lacks); `fast_forward`: verify the
        tokens it forces as drafts (the tests switch it off to compare). llguidance
        drops the GIL while it builds the matcher."""
        with contain_panics(f"building the {grammar.kind} grammar's matcher"):
            matcher = llguidance.LLMatcher(
                self._tok, grammar.source, log_level=0, limits=parser_limits()
            )
            if matcher.is_error():
                raise RequestError(
                    f"invalid {grammar.kind} grammar: {public_message(matcher.get_error())}"
                )
        return Constraint(
            matcher, self.vocab_size, grammar.kind, fast_forward=fast_forward, owner=self.owner
        )
