"""What a running request reports, in order: `Accepted`, any number of `Progress` (during
a long prefill) and `Token`, then one `Done` or `Failed`. Plain frozen records shared by
every front end (SERVE and HTTP)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accepted:
    """Validated and tokenised; sent before the prefill (the client may commit late)."""

    prompt_tokens: int
    cached_tokens: int  # prefix reused from the conversation's KV cache


@dataclass(frozen=True)
class Progress:
    """A long prefill is under way: `done` of `total` layers computed (sent at most about
    once a second, so a client can show it and an HTTP stream can keep its connection)."""

    done: int
    total: int


@dataclass(frozen=True)
class Token:
    """The text one generated token releases (never empty: held-back pieces are skipped)."""

    text: str


@dataclass(frozen=True)
class Done:
    """finish: "stop" (stop token/string), "length", or "stopped" (a STOP request)."""

    finish: str
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int
    prefill_s: float
    decode_s: float
    prefill_tok_s: float
    decode_tok_s: float
    stop_string: str | None = None  # the stop string that ended the answer, if one did
    speculation: dict[str, str] | None = None  # what speculative decoding did, when on
    constraint: dict[str, str] | None = None  # the grammar and its mask cost, when one ran


@dataclass(frozen=True)
class Failed:
    """The request ends without an answer; `code` is a SERVE error code."""

    code: str
    message: str


Event = Accepted | Progress | Token | Done | Failed
TERMINAL = (Done, Failed)
