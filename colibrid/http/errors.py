"""`ApiError`: one failed HTTP request, rendered as an OpenAI-style JSON error body
(``{"error": {"message", "type", "param", "code"}}``) with its status; and the mapping
from the scheduler's error codes (SERVE codes) to those statuses."""

from __future__ import annotations

import json
from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "server_error",
    502: "api_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error")

    def body(self, *, anthropic: bool = False) -> dict[str, Any]:
        """OpenAI's shape; `anthropic` adds the top-level ``"type": "error"`` Anthropic
        clients look for (the inner object carries both APIs' fields)."""
        inner = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"type": "error", "error": inner} if anthropic else {"error": inner}

    def json_bytes(self, *, anthropic: bool = False) -> bytes:
        return json.dumps(self.body(anthropic=anthropic)).encode()

    def ollama_bytes(self) -> bytes:
        """Ollama's shape, ``{"error": "<message>"}`` (its clients raise the message)."""
        return json.dumps({"error": self.message}, ensure_ascii=False).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def context_exceeded(message: str) -> ApiError:
    return ApiError(400, message, param="messages", code="context_length_exceeded")


def from_code(
    code: str, message: str, *, retry_after_s: int = 1, max_context: int | None = None
) -> ApiError:
    """A scheduler / engine-host failure (a SERVE error code) as an HTTP error."""
    if code == "BUSY":
        return ApiError(
            429, message, code="queue_full", headers=(("retry-after", str(retry_after_s)),)
        )
    if code == "SHUTTING_DOWN":
        return ApiError(503, message, code="shutting_down")
    if code == "MODEL_BUSY":  # another model answers requests: this one loads when idle
        return ApiError(
            503, message, code="model_busy", headers=(("retry-after", str(retry_after_s)),)
        )
    if code == "NOT_FOUND":
        return ApiError(404, message, code="model_not_found", param="model")
    if code == "CONTEXT_EXCEEDED":
        limit = f" of {max_context} tokens" if max_context else ""
        return context_exceeded(
            f"the prompt is longer than this model's context{limit} "
            "allows (it is never truncated); shorten it"
        )
    if code in ("BAD_REQUEST", "EMPTY_PROMPT", "TEMPLATE"):
        return ApiError(400, message, code=code.lower())
    if code == "CANCELLED":
        return ApiError(503, message, code="cancelled")
    if code == "REMOTE":  # a remote model's endpoint failed (colibrid.remote)
        return ApiError(502, message, code="remote_error")
    if code == "IO":  # the daemon could not read or write its own files (saved KV, profiles)
        return ApiError(500, message, code="io_error")
    return ApiError(500, message, code=code.lower())
