"""OpenAI's `n`: several choices for one prompt, each a request of its own.

Why separate requests: a choice is a generation with its own sampler, text and end; the
batcher already decodes concurrent requests in shared passes (each expert read once for
every row that chose it), so n choices cost far less than n requests one after the other,
and each computes exactly what it would alone (batched equals alone). The prompt is
prefilled once: choice 0 computes it, and the others start from a copy of its KV and the
logits after it (`Scheduler.submit_nowait(same_prompt_as=...)`, serve.host), so their
first token is sampled from the very numbers choice 0's was.

Seeds: with a `seed`, choice i samples with seed ``(seed + i) mod 2**64`` (choice 0 is the
answer the same request with n = 1 gives); without one each draws its own from the OS.
Greedy decoding (temperature 0) gives n equal choices: that is what it means.

`Choices` turns the choices' events into one response: chunks carry their choice's
`index`; the usage counts the prompt once and every choice's tokens.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from colibri_protocol.messages import Logprobs

from colibrid.serve.events import Done
from colibrid.serve.requests import GenerateRequest

MAX_SEED = 2**64


class ChoiceTranslator(Protocol):
    """What `ChatStream` and `CompletionStream` offer (http.openai)."""

    index: int
    id: str

    def start(self) -> list[dict[str, Any]]: ...

    def token(self, text: str, logprobs: Logprobs | None = None) -> list[dict[str, Any]]: ...

    def finish(self, done: Done) -> list[dict[str, Any]]: ...

    def response(self, done: Done) -> dict[str, Any]: ...


def choice_request(request: GenerateRequest, i: int) -> GenerateRequest:
    """The request of choice `i` (choice 0 is `request` itself)."""
    if i == 0:
        return request
    seed = request.params.seed
    params = replace(request.params, seed=None if seed is None else (seed + i) % MAX_SEED)
    return replace(request, id=f"{request.id}-{i}", params=params)


def combined_usage(dones: list[Done]) -> dict[str, Any]:
    """OpenAI's usage of an `n` > 1 answer: the prompt once, every choice's tokens."""
    first = dones[0]
    completion = sum(d.generated_tokens for d in dones)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


class Choices:
    """The translators of the n choices (each numbered by its `index`, all under the
    first one's id) as one: `token` and `finish` name the choice."""

    def __init__(self, translators: list[ChoiceTranslator], include_usage: bool) -> None:
        self.translators = translators
        self.include_usage = include_usage
        for i, t in enumerate(translators):
            t.index = i
            t.id = translators[0].id
        self._envelope: dict[str, Any] = {}

    def start(self) -> list[dict[str, Any]]:
        return [chunk for t in self.translators for chunk in t.start()]

    def token(self, i: int, text: str, logprobs: Logprobs | None) -> list[dict[str, Any]]:
        return self.translators[i].token(text, logprobs)

    def finish(self, i: int, done: Done) -> list[dict[str, Any]]:
        chunks = self.translators[i].finish(done)
        self._envelope = chunks[-1] if chunks else self._envelope
        return chunks

    def usage_chunk(self, dones: list[Done]) -> list[dict[str, Any]]:
        """The last streamed chunk with `stream_options.include_usage` (after every
        choice's finish: its envelope is the last finish chunk's)."""
        if not self.include_usage or not self._envelope:
            return []
        return [{**self._envelope, "choices": [], "usage": combined_usage(dones)}]

    def response(self, dones: list[Done]) -> dict[str, Any]:
        bodies = [t.response(d) for t, d in zip(self.translators, dones, strict=True)]
        merged = dict(bodies[0])
        merged["choices"] = [c for b in bodies for c in b["choices"]]
        merged["usage"] = combined_usage(dones)
        return merged
