"""A request made ready for the engine thread, on the trio side: its prompt tokenised (the
chat template rendered) in a bounded worker thread, its grammar compiled (serve.grammars:
a worker process) and its matcher built, both for the model loaded now.

Why here: the engine thread runs every request's passes; a long prompt's tokenising, a
chat template's rendering or a grammar's compiling there would stall every request
sharing the engine for its duration. Here it stalls nothing: the event loop awaits a
thread (the tokenizer and llguidance release the GIL), and SERVE and HTTP prepare their
requests the same way. The engine thread receives ids and a matcher, each stamped with
the engine they were made for (`owner`): a model switched meanwhile fails the request
with a one-line "send it again" instead of running ids of another vocabulary.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import trio

from colibrid.engine.tokenizer import TextCodec
from colibrid.errors import NoModel, RequestError, contain_panics
from colibrid.serve.grammars import GrammarService
from colibrid.serve.models import Loaded
from colibrid.serve.requests import GenerateRequest

TOKENIZE_THREADS = 2  # prompts tokenised at once (each takes a core while it runs)


class GrammarRefused(RequestError):
    """The request's grammar cannot be compiled (or is too complex): a front end names
    the field it came in."""


class Preparer:
    """Prepares requests for the engine (one per daemon)."""

    def __init__(self, grammars: GrammarService) -> None:
        self.grammars = grammars
        self._threads: trio.CapacityLimiter | None = None  # made inside the trio run
        self.preparing = 0  # requests being tokenised or their grammar compiled (STATUS)

    async def prepare(self, request: GenerateRequest, loaded: Loaded | None) -> GenerateRequest:
        """`request` with its prompt ids (and matcher) for the model `loaded`; RequestError
        (or the code the tokenizer or template gave) with the reason otherwise."""
        self.preparing += 1
        try:
            return await self._prepare(request, loaded)
        finally:
            self.preparing -= 1

    async def _prepare(self, request: GenerateRequest, loaded: Loaded | None) -> GenerateRequest:
        if loaded is None:
            raise NoModel("no model is loaded")
        if loaded.codec is None:
            raise RequestError("this model has no tokenizer.json; it cannot take text prompts")
        if self._threads is None:
            self._threads = trio.CapacityLimiter(TOKENIZE_THREADS)
        ids = await trio.to_thread.run_sync(
            partial(tokenize, loaded.codec, request), limiter=self._threads
        )
        if not ids:
            raise RequestError("the prompt renders to no tokens", code="EMPTY_PROMPT")
        limit = loaded.engine.max_context
        if len(ids) >= limit:
            raise RequestError(
                f"{len(ids)} {limit}: the prompt leaves no room for a generated token",
                code="CONTEXT_EXCEEDED",
            )
        if request.params.logprobs is not None:  # each token's bytes, known before it runs
            await trio.to_thread.run_sync(loaded.codec.token_bytes, 0, limiter=self._threads)
        constraint = None
        if request.grammar is not None:
            try:
                constraint = await self.grammars.constraint(
                    request.grammar, loaded.engine, loaded.codec
                )
            except RequestError as exc:
                raise GrammarRefused(str(exc), code=exc.code) from None
        return replace(
            request, prompt_ids=tuple(ids), owner=id(loaded.engine), constraint=constraint
        )


def tokenize(codec: TextCodec, request: GenerateRequest) -> list[int]:
    """The request's prompt as ids: its messages through the chat template (with the
    tools it shows), or its raw text with the tokenizer's own special tokens."""
    with contain_panics("the model's tokenizer"):
        if request.messages is not None:
            return codec.encode_chat(
                list(request.messages),
                add_generation_prompt=True,
                tools=list(request.tools) if request.tools else None,
            )
        return codec.encode(request.prompt or "", add_special_tokens=True)
