"""What a running request reports, in order: `Accepted`, any number of `Progress` (during
a long prefill) and `Token`, then one `Done` or `Failed`. Plain frozen records shared by
every front end (SERVE and HTTP)."""

from __future__ import annotations

from dataclasses import dataclass, field

from colibri_protocol.messages import Logprobs

from colibrid.engine.events import DoneEvent


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
    """The text one generated token releases (never empty: held-back pieces are skipped),
    or, for a request asking for logprobs, every generated token with its logprobs
    (`text` may then be empty)."""

    text: str
    logprobs: Logprobs | None = None


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
    plan: str | None = None  # the id of the precision plan that computed it
    # its share of the machine's ceilings (serve.roofline; empty before they are measured)
    roofline: dict[str, float | str] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        event: DoneEvent,
        cached_tokens: int,
        plan: str | None = None,
        roofline: dict[str, float | str] | None = None,
    ) -> Done:
        """The engine's end of a request as the front ends report it (a cancel that was
        a STOP request finishes "stopped"); `plan` is the engine's precision plan id,
        `roofline` the request's roofline figures."""
        stats = event.stats
        return cls(
            "stopped" if event.finish_reason == "cancelled" else event.finish_reason,
            stats.prompt_tokens,
            stats.generated_tokens,
            cached_tokens,
            stats.prefill_s,
            stats.decode_s,
            stats.prefill_tok_s,
            stats.decode_tok_s,
            event.stop_string,
            None if event.spec is None else event.spec.extras(),
            None if event.constraint is None else event.constraint.extras(),
            plan,
            roofline or {},
        )


@dataclass(frozen=True)
class Failed:
    """The request ends without an answer; `code` is a SERVE error code."""

    code: str
    message: str


Event = Accepted | Progress | Token | Done | Failed
TERMINAL = (Done, Failed)


def roofline_words(figures: dict[str, float | str]) -> str:
    """The roofline figures as the log line says them (empty without them)."""
    if not figures:
        return ""
    disk = figures.get("disk_share")
    on_disk = "" if disk is None else f"disk {100 * float(disk):.0f}% of probe, "
    kernels = figures.get("kernel_share")
    on_cpu = "" if kernels is None else f"kernels {100 * float(kernels):.0f}%, "
    return (
        f" ({on_disk}memory {100 * float(figures['memory_share']):.0f}% of probe, {on_cpu}"
        f"roofline {100 * float(figures['roofline_share']):.0f}% ({figures['bound']}-bound))"
    )


def summary(event: Event) -> str:
    """A finished request as the log's one line about it (`colibri logs`)."""
    if isinstance(event, Done):
        spec = event.speculation or {}
        drafts = f", {spec['accepted']}/{spec['drafted']} drafts kept" if "drafted" in spec else ""
        grammar = event.constraint or {}
        if grammar:
            drafts += f", {grammar['grammar']} grammar ({grammar['mask_us']} µs a token)"
        return (
            f"{event.prompt_tokens} prompt ({event.cached_tokens} cached) + "
            f"{event.generated_tokens} tokens, prefill {event.prefill_tok_s:.1f} tok/s, "
            f"decode {event.decode_tok_s:.1f} tok/s{roofline_words(event.roofline)}, "
            f"finish={event.finish}{drafts}"
        )
    if isinstance(event, Failed):
        return f"failed {event.code}: {event.message}"
    return type(event).__name__
