"""SUBMIT's grammar payload: what a constrained answer must look like.

The payload is one JSON object with exactly one key: ``{"json_schema": {...}}`` (a JSON
schema: the answer is JSON that validates), ``{"lark": "..."}`` (a Lark grammar, in
llguidance's dialect) or ``{"regex": "..."}`` (the whole answer matches). `format=json`
is Ollama's shorthand for ``{"json_schema": {"type": "object"}}``. Only the shape is
checked here; whether the schema or grammar is valid is the daemon's question (it
answers BAD_REQUEST with the reason before any token is generated).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from colibri_protocol.bounded_json import JsonTooDeep, loads_bounded
from colibri_protocol.errors import ProtocolError

KINDS = ("json_schema", "lark", "regex")
FORMATS = ("json",)  # the values of SUBMIT's format= option


def format_grammar(name: str) -> dict[str, Any]:
    """The grammar spec a `format=` value stands for (json: any JSON object)."""
    if name != "json":
        raise ValueError(f"unknown format {name!r}")
    return {"json_schema": {"type": "object"}}


def parse_grammar(data: bytes, rid: str) -> dict[str, Any]:
    """The grammar payload as a one-key dict, or BAD_REQUEST naming what is wrong."""
    try:
        value = loads_bounded(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ProtocolError("BAD_REQUEST", "grammar payload is not valid UTF-8", rid) from None
    except JsonTooDeep as exc:
        raise ProtocolError("BAD_REQUEST", f"grammar payload refused: {exc}", rid) from None
    except ValueError as exc:
        raise ProtocolError("BAD_REQUEST", f"grammar payload is not JSON: {exc}", rid) from None
    return checked_grammar(value, rid)


def checked_grammar(value: Any, rid: str = "-") -> dict[str, Any]:
    """`value` when it is a grammar spec of the right shape, else BAD_REQUEST."""
    shape = (
        'grammar payload must be one of {"json_schema": {...}}, {"lark": "..."}, {"regex": "..."}'
    )
    if not isinstance(value, Mapping) or len(value) != 1 or next(iter(value)) not in KINDS:
        raise ProtocolError("BAD_REQUEST", shape, rid)
    ((kind, body),) = value.items()
    if kind == "json_schema" and not isinstance(body, (dict, bool)):
        raise ProtocolError("BAD_REQUEST", "json_schema must be a JSON object", rid)
    if kind != "json_schema" and (not isinstance(body, str) or not body):
        raise ProtocolError("BAD_REQUEST", f"{kind} must be a non-empty string", rid)
    return {kind: body}


def encode_grammar(grammar: Mapping[str, Any]) -> bytes:
    """The payload bytes of a grammar spec (compact JSON, UTF-8)."""
    return json.dumps(dict(grammar), ensure_ascii=False, separators=(",", ":")).encode("utf-8")
