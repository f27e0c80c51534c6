"""The OpenAPI 3.0 description served at ``/openapi.json`` (and fuzzed by the tests)."""

from __future__ import annotations

from typing import Any

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}],
            "nullable": True,
        },
    },
}
_STOP = {
    "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
    "nullable": True,
}
_MODEL = {"type": "string", "minLength": 1}
_SAMPLING = {
    "model": _MODEL,
    "max_tokens": {"type": "integer", "minimum": 1, "nullable": True},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
    "seed": {"type": "integer", "minimum": 0, "maximum": 2**64 - 1, "nullable": True},
    "stop": _STOP,
    "stream": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 1, "maximum": 8, "nullable": True},
    "top_k": {"type": "integer", "minimum": 0, "nullable": True},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True},
    # llama-server's extensions (engine.penalties)
    "repeat_penalty": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "nullable": True},
    "repeat_last_n": {"type": "integer", "minimum": -1, "nullable": True},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
}
_RESPONSE_FORMAT = {  # structured output: the answer is JSON of this schema
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
        "json_schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "schema": {"type": "object"},
                "strict": {"type": "boolean", "nullable": True},
            },
        },
    },
    "nullable": True,
}
_TOOL_CHOICE = {
    "oneOf": [
        {"type": "string", "enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}},
                },
            },
        },
    ],
    "nullable": True,
}
_ERROR = {
    "description": "an OpenAI-style error",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["error"],
                "properties": {"error": {"type": "object", "required": ["message", "type"]}},
            }
        }
    },
}
_ERRORS = {str(s): _ERROR for s in (400, 401, 403, 404, 408, 413, 415, 429, 503)}


def _post(summary: str, required: list[str], props: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"type": "object", "required": required, "properties": props}
                    }
                },
            },
            "responses": {
                "200": {"description": "the answer (JSON, or SSE when streaming)"},
                **_ERRORS,
            },
        }
    }


def _get(summary: str, params: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": "ok"}, **_ERRORS},
    }
    if params:
        op["parameters"] = params
    return {"get": op}


_ANTHROPIC_MESSAGES = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "properties": {
            "role": {"type": "string", "enum": ["user", "assistant"]},
            "content": {"type": "string"},
        },
    },
}


def describe(model: str) -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "colibri",
            "version": "1",
            "description": f"OpenAI- and Anthropic-compatible API serving {model}",
        },
        "paths": {
            "/health": _get("liveness"),
            "/metrics": _get("Prometheus metrics"),
            "/v1/models": _get("the served model"),
            "/v1/models/{model}": _get(
                "one model",
                [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            ),
            "/v1/chat/completions": _post(
                "chat",
                ["model", "messages"],
                {
                    **_SAMPLING,
                    "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
                    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                    "tools": {"type": "array", "items": {"type": "object"}},
                    "tool_choice": _TOOL_CHOICE,
                    "response_format": _RESPONSE_FORMAT,
                    "stream_options": {"type": "object", "nullable": True},
                    "logprobs": {"type": "boolean", "nullable": True},
                    "top_logprobs": {
                        "type": "integer",
                        "minimum": 0,
                        "maximum": 20,
                        "nullable": True,
                    },
                },
            ),
            "/v1/completions": _post(
                "raw completion",
                ["model", "prompt"],
                {
                    **_SAMPLING,
                    "prompt": {"type": "string"},
                    "response_format": _RESPONSE_FORMAT,
                    "logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "nullable": True},
                },
            ),
            "/v1/responses": _post(
                "OpenAI Responses",
                ["model", "input"],
                {
                    "model": _MODEL,
                    "input": {
                        "oneOf": [
                            {"type": "string"},
                            {"type": "array", "minItems": 1, "items": {"type": "object"}},
                        ]
                    },
                    "instructions": {"type": "string", "nullable": True},
                    "max_output_tokens": {"type": "integer", "minimum": 1, "nullable": True},
                    "temperature": _SAMPLING["temperature"],
                    "top_p": _SAMPLING["top_p"],
                    "seed": _SAMPLING["seed"],
                    "stream": {"type": "boolean", "nullable": True},
                    "store": {"type": "boolean", "nullable": True},
                    "previous_response_id": {"type": "string", "nullable": True},
                    "metadata": {
                        "type": "object",
                        "additionalProperties": {"type": "string", "maxLength": 512},
                        "maxProperties": 16,
                        "nullable": True,
                    },
                    "tools": {"type": "array", "items": {"type": "object"}},
                    "tool_choice": {
                        "oneOf": [
                            {"type": "string", "enum": ["none", "auto", "required"]},
                            {
                                "type": "object",
                                "required": ["type", "name"],
                                "properties": {
                                    "type": {"type": "string", "enum": ["function"]},
                                    "name": {"type": "string"},
                                },
                            },
                        ],
                        "nullable": True,
                    },
                    "parallel_tool_calls": {"type": "boolean", "nullable": True},
                    "text": {"type": "object", "nullable": True},
                    "include": {
                        "type": "array",
                        "items": {"type": "string", "enum": ["message.output_text.logprobs"]},
                        "nullable": True,
                    },
                    "top_logprobs": {
                        "type": "integer",
                        "minimum": 0,
                        "maximum": 20,
                        "nullable": True,
                    },
                },
            ),
            "/v1/messages": _post(
                "Anthropic Messages",
                ["model", "messages", "max_tokens"],
                {
                    "model": _MODEL,
                    "max_tokens": {"type": "integer", "minimum": 1},
                    "system": {"type": "string"},
                    "messages": _ANTHROPIC_MESSAGES,
                    "stop_sequences": {"type": "array", "items": {"type": "string"}},
                    "tools": {"type": "array", "items": {"type": "object"}},
                    "tool_choice": {"type": "object"},
                    "temperature": {"type": "number"},
                    "stream": {"type": "boolean"},
                },
            ),
            "/v1/messages/count_tokens": _post(
                "Anthropic token count of a Messages request's prompt",
                ["model", "messages"],
                {
                    "model": _MODEL,
                    "system": {"type": "string"},
                    "messages": _ANTHROPIC_MESSAGES,
                    "tools": {"type": "array", "items": {"type": "object"}},
                    "tool_choice": {"type": "object"},
                },
            ),
        },
    }
