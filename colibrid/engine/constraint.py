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
the engine sees the request. Its mask costs 50-340 microseconds a token on the demo's
49k vocabulary (`mask_us` on the DONE line; string contents cost most), against ~18 ms a
decode step there (README, "Structured output").

`Grammar` validates and compiles (cheap, no model needed); `Vocabulary` is the model's
tokenizer as llguidance sees it (built once per model, on the first constrained
request); `Constraint` is one request's matcher and its cost.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from colibrid.errors import ColibriError, RequestError

KINDS = ("json_schema", "lark", "regex")
# JSON as models write it (`{"a": 1, "b": [2, 3]}`) and nothing else: flexible whitespace
# lets a small model wander into blank lines until max_tokens. A schema's own
# "x-guidance" options win over these.
JSON_STYLE: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
MAX_MESSAGE = 300  # characters of llguidance's (multi-line) message an error quotes
_POINTER_LINE = re.compile(r"^\s*(\d+\s*\||\^)")  # the source excerpt under a Lark error


class ConstraintError(ColibriError):
    """The grammar and the model's vocabulary disagree mid-answer (a token the mask
    allowed was refused, or no token is allowed): that request fails, no other."""

    code = "BAD_REQUEST"


def _one_line(message: str) -> str:
    """llguidance's message without its source excerpt, on one bounded line."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    text = "; ".join(ln for ln in lines if not _POINTER_LINE.match(ln))
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def styled_schema(schema: Mapping[str, Any] | bool) -> dict[str, Any] | bool:
    """`schema` with `JSON_STYLE` as its x-guidance defaults (what `%json{...}` inside a
    Lark grammar needs, since only a top-level JSON schema takes options)."""
    if isinstance(schema, bool):
        return schema
    own = schema.get("x-guidance")
    style = {**JSON_STYLE, **own} if isinstance(own, Mapping) else JSON_STYLE
    return {**schema, "x-guidance": style}


@dataclass(frozen=True)
class Grammar:
    """A validated grammar: `kind` as the client gave it (json_schema, lark, regex, or a
    name the edge chose, such as tool_call) and `source`, llguidance's compiled form.
    Build with `json_schema`, `lark`, `regex` or `from_spec`; each raises RequestError
    with llguidance's reason on one line, before any token is generated."""

    kind: str
    source: str

    @classmethod
    def json_schema(cls, schema: Any, *, kind: str = "json_schema") -> Grammar:
        if not isinstance(schema, (dict, bool)):
            raise RequestError("a JSON schema must be an object (or true/false)")
        try:
            source = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=JSON_STYLE
            )
        except (ValueError, TypeError) as exc:
            raise RequestError(f"invalid JSON schema: {_one_line(str(exc))}") from None
        return cls._checked(kind, source, "JSON schema")

    @classmethod
    def lark(cls, text: Any, *, kind: str = "lark") -> Grammar:
        if not isinstance(text, str) or not text.strip():
            raise RequestError("a Lark grammar must be a non-empty string")
        return cls._checked(kind, llguidance.LLMatcher.grammar_from_lark(text), "Lark grammar")

    @classmethod
    def regex(cls, text: Any) -> Grammar:
        if not isinstance(text, str) or not text:
            raise RequestError("a regex must be a non-empty string")
        return cls._checked("regex", llguidance.LLMatcher.grammar_from_regex(text), "regex")

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Grammar:
        """`{"json_schema": {...}}`, `{"lark": "..."}` or `{"regex": "..."}` (SERVE's
        grammar payload, `colibri ask --json-schema | --grammar`)."""
        keys = [k for k in spec if k in KINDS]
        if len(spec) != 1 or len(keys) != 1:
            raise RequestError(
                'a grammar is one of {"json_schema": {...}}, {"lark": "..."}, {"regex": "..."}'
            )
        kind = keys[0]
        value = spec[kind]
        if kind == "json_schema":
            return cls.json_schema(value)
        return cls.lark(value) if kind == "lark" else cls.regex(value)

    @classmethod
    def _checked(cls, kind: str, source: str, what: str) -> Grammar:
        problem = llguidance.LLMatcher.validate_grammar(source)
        if problem:
            raise RequestError(f"invalid {what}: {_one_line(problem)}")
        return cls(kind, source)


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
    ) -> None:
        self._matcher = matcher
        self._n = vocab_size
        self._bits = np.full((vocab_size + 31) // 32, -1, dtype="<i4")
        self.kind = kind
        self.fast_forward = fast_forward
        self.tokens = 0
        self.seconds = 0.0

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """`logits` with every token the grammar forbids next at -inf (a new array)."""
        t0 = time.perf_counter()
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
        ok = self._matcher.consume_token(int(token))
        self.seconds += time.perf_counter() - t0
        self.tokens += 1
        if not ok:
            self._check()
            raise ConstraintError(f"token {token} does not fit the {self.kind} grammar")

    @property
    def complete(self) -> bool:
        """Nothing but a stop token may follow: the answer is whole."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (none unless `fast_forward`):
        drafts the next pass verifies with the model, so that the fixed text of a JSON
        object costs one pass, not one a token."""
        if not self.fast_forward or limit <= 0:
            return []
        t0 = time.perf_counter()
        tokens = self._matcher.compute_ff_tokens()[:limit]
        self.seconds += time.perf_counter() - t0
        return [int(t) for t in tokens]

    def drafts(self, tokens: Sequence[int]) -> list[int]:
        """The leading `tokens` the grammar accepts from here (speculative drafts past
        the first refused one could never be kept)."""
        if not tokens:
            return []
        return list(tokens[: self._matcher.validate_tokens([int(t) for t in tokens])])

    def stats(self) -> ConstraintStats:
        return ConstraintStats(self.kind, self.tokens, self.seconds)

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ConstraintError(
                f"the {self.kind} grammar failed: {_one_line(self._matcher.get_error())}"
            )


class Vocabulary:
    """The model's tokenizer as llguidance needs it, to know each token's bytes: built
    from the serialized `tokenizers` tokenizer (a fraction of a second for 49k tokens;
    the engine host builds it on the first constrained request). `vocab_size` is the
    model's logits size (it may exceed the tokenizer's: those ids are never allowed);
    `stop_ids` are the tokens that end an answer, allowed only where the grammar accepts."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_ids: frozenset[int]) -> None:
        try:
            self._tok = llguidance.LLTokenizer(
                tokenizer_json, n_vocab=vocab_size, eos_token=sorted(stop_ids) or None
            )
        except Exception as exc:  # the Rust side raises plain exceptions
            raise RequestError(
                f"this model's tokenizer cannot drive a grammar: {_one_line(str(exc))}"
            ) from None
        self.vocab_size = vocab_size

    def constraint(self, grammar: Grammar, *, fast_forward: bool = True) -> Constraint:
        """A fresh matcher for `grammar` (RequestError when it does not fit this model's
        tokens, e.g. a special token the tokenizer lacks); `fast_forward`: verify the
        tokens it forces as drafts (the tests switch it off to compare)."""
        matcher = llguidance.LLMatcher(self._tok, grammar.source, log_level=0)
        if matcher.is_error():
            raise RequestError(f"invalid {grammar.kind} grammar: {_one_line(matcher.get_error())}")
        return Constraint(matcher, self.vocab_size, grammar.kind, fast_forward=fast_forward)
