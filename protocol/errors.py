"""Named error codes of the SERVE protocol (the third field of an `ERROR` line).

One table, so the spec, the daemon and the clients cannot drift apart: SERVE.md lists the
same codes, and tests/protocol checks that every code here is documented there.
Codes shared with upstream colibri's mux protocol keep upstream's spelling.
"""

from __future__ import annotations

# code -> when it is sent (also the text of SERVE.md's error table)
CODES: dict[str, str] = {
    "BAD_FRAME": "a line that cannot be parsed: unknown syntax, bad byte count, not UTF-8, "
    "payload not followed by LF",
    "LINE_TOO_LONG": "a header line longer than the limit; the rest of the line is skipped",
    "UNKNOWN_VERB": "a request verb the daemon does not know",
    "BAD_REQUEST": "a well-formed request with invalid content (sampling values, JSON, options, "
    "a schema or grammar that does not compile)",
    "EMPTY_PROMPT": "a SUBMIT whose prompt renders to no tokens",
    "DUPLICATE_ID": "a SUBMIT reusing the id of a request still in flight on this connection",
    "NOT_FOUND": "STOP or CANCEL for an id that is not in flight; an unknown profile or model",
    "CONTEXT_EXCEEDED": "the prompt does not leave room for one generated token",
    "BUSY": "the request queue is full; try again later",
    "CONV_BUSY": "another request of the same conversation is still running",
    "TOO_LARGE": "a payload above the size limit; the connection is closed",
    "CANCELLED": "the request was cancelled by its client (CANCEL)",
    "SHUTTING_DOWN": "the daemon is stopping: a new request is refused, a queued one dropped, "
    "and one still running when the grace period ends is cancelled",
    "TEMPLATE": "the model's chat template failed on this request or went over a limit "
    "(output size, render time); the message names the model and the limit",
    "IO": "a write of persistent state failed (full disk, I/O error); the message names "
    "the path; the daemon goes on",
    "MODEL_BUSY": "the request names a model other than the one loaded while requests of that "
    "one run (or another is loading); it is loaded when the daemon is idle",
    "NO_MODEL": "no model is loaded (after `UNLOAD` or keep_alive), for a request that needs "
    "one and does not load one (MODEL, PROFILE, UNLOAD)",
    "REMOTE": "a remote model's endpoint failed (unreachable, an error status, a timeout, a "
    "broken stream); the message names the endpoint and what it said",
    "INTERNAL": "an unexpected failure inside the daemon; the request is lost, the daemon lives",
}

#: Codes after which the daemon closes the connection (the framing is lost).
FATAL = frozenset({"TOO_LARGE"})


class ProtocolError(Exception):
    """A frame or request the peer must be told about with `ERROR <id> <code> <message>`.

    `request_id` is "-" when the offending line carries no usable id.
    """

    def __init__(self, code: str, message: str, request_id: str = "-") -> None:
        if code not in CODES:
            raise ValueError(f"unknown protocol error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id

    @property
    def fatal(self) -> bool:
        return self.code in FATAL
