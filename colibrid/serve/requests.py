"""`GenerateRequest`: a request validated once, at the edge, from its protocol form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from colibri_protocol.messages import Submit

from colibrid.engine.constraint import Constraint
from colibrid.engine.grammar import Grammar
from colibrid.engine.sampling import SamplingParams
from colibrid.engine.speculate import SpecSettings
from colibrid.remote.spec import RemoteSpec


@dataclass(frozen=True)
class Asked:
    """What an HTTP client asked of the answer, in OpenAI's terms: `tool_choice` ("auto",
    "none", "required", or {"type": "function", "function": {"name": ...}}) and `schema`
    (the JSON schema of `response_format`; None: text). colibri's engine is held to the
    `grammar` it derives from these; a remote model is sent these instead, since it
    writes and parses its own calls (serve.remote_body)."""

    tool_choice: str | dict[str, Any] = "auto"
    schema: dict[str, Any] | bool | None = None


@dataclass(frozen=True)
class GenerateRequest:
    """`client` identifies the connection (fair queueing, conversation ownership)."""

    id: str
    client: int
    params: SamplingParams
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    conv: str | None = None
    profile: str | None = None
    tools: tuple[dict[str, Any], ...] | None = None  # for the chat template (HTTP API)
    speculate: str | None = None  # speculation mode (None: the daemon's)
    draft_max: int | None = None  # deepest draft (None: the daemon's)
    keep_alive: float | None = None  # seconds the model stays loaded once idle (None: as set)
    grammar: Grammar | None = None  # what the answer must look like (shape checked at the edge)
    asked: Asked | None = None  # the same in OpenAI's terms, from an HTTP dialect
    # the remote model that answers it (serve.remote_runs), set when it is prepared
    remote: RemoteSpec | None = field(default=None, compare=False)
    # made on the trio side before the request is queued (serve.prepare), for the engine
    # `owner` (its id()): the prompt's ids and the grammar's matcher
    prompt_ids: tuple[int, ...] | None = field(default=None, compare=False, repr=False)
    owner: int = field(default=0, compare=False, repr=False)
    constraint: Constraint | None = field(default=None, compare=False, repr=False)

    def speculation(self, default: SpecSettings) -> SpecSettings:
        """The request's speculative decoding: its own mode and depth over the daemon's."""
        if self.speculate is None and self.draft_max is None:
            return default
        depth = default.max_depth if self.draft_max is None else self.draft_max  # 0 is refused
        return SpecSettings(self.speculate or default.mode, depth)

    @classmethod
    def from_submit(cls, submit: Submit, client: int) -> GenerateRequest:
        """Raises RequestError (BAD_REQUEST) with the reason for invalid sampling values
        or a grammar of the wrong shape or past the caps (before any token is generated;
        compiling it is the grammar service's)."""
        params = SamplingParams(
            max_tokens=submit.max_tokens,
            temperature=submit.temperature,
            top_p=submit.top_p,
            top_k=submit.top_k,
            seed=submit.seed,
            stop=submit.stop,
            repeat_penalty=submit.repeat_penalty,
            repeat_last_n=submit.repeat_last_n,
            frequency_penalty=submit.frequency_penalty,
            presence_penalty=submit.presence_penalty,
            min_p=submit.min_p,
            logprobs=submit.logprobs,
        )
        request = cls(
            id=submit.id,
            client=client,
            params=params,
            prompt=submit.prompt,
            messages=submit.messages,
            conv=submit.conv,
            profile=submit.profile,
            speculate=submit.speculate,
            draft_max=submit.draft_max,
            keep_alive=submit.keep_alive,
            grammar=Grammar.from_spec(submit.grammar) if submit.grammar is not None else None,
        )
        request.speculation(SpecSettings())  # refused at the edge, with the reason
        return request
