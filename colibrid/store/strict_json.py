"""Strict parsing of untrusted JSON, and safe quoting of untrusted names in messages.

Why this module exists: safetensors headers, ``model.safetensors.index.json``,
config.json and the converter's progress file all come from untrusted mirrors, and
upstream colibri had memory-safety advisories from malicious ones. Every such document
goes through :func:`load_json_object`, which refuses anything two readers could disagree
on (duplicate keys, NaN, huge integer literals, deep nesting) as one error line; and
every untrusted key or tensor name printed in such a line goes through :func:`describe`.
"""

from __future__ import annotations

import json

from colibrid.errors import CheckpointError, ColibriError

MAX_INT_DIGITS = 24
"""Longer JSON integer literals are refused before conversion (no quadratic int())."""


def describe(name: object, limit: int = 80) -> str:
    """A tensor/key name made safe for a one-line message (quoted, escaped, truncated)."""
    text = repr(name)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _JsonReject(Exception):
    """Raised from inside json hooks; turned into the caller's error class."""


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _JsonReject(f"duplicate key {describe(key)}")
            seen.add(key)
    return obj


def _bounded_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:
        raise _JsonReject(f"integer literal with {len(text)} digits")
    return int(text)


def _reject_constant(text: str) -> object:
    raise _JsonReject(f"non-standard JSON constant {text}")


def _reject_float(text: str) -> object:
    raise _JsonReject(f"non-integer number {text[:24]}")


def load_json_object(
    raw: bytes,
    what: str,
    error: type[ColibriError] = CheckpointError,
    *,
    integers_only: bool = False,
) -> dict[str, object]:
    """Parse untrusted JSON that must be an object, strictly, as one ``error`` line.

    Strict means: UTF-8 only, no duplicate keys (two readers could pick different
    values), no NaN/Infinity, no absurd integer literals, bounded nesting; with
    ``integers_only`` (safetensors headers) no fractional numbers either.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what}: not valid UTF-8 (byte {exc.start})") from None
    try:
        obj = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_int=_bounded_int,
            parse_constant=_reject_constant,
            parse_float=_reject_float if integers_only else None,
        )
    except _JsonReject as exc:
        raise error(f"{what}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise error(
            f"{what}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except RecursionError:
        raise error(f"{what}: JSON nested too deeply") from None
    except ValueError as exc:  # e.g. a float literal Python refuses
        raise error(f"{what}: invalid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise error(f"{what}: expected a JSON object, got {type(obj).__name__}")
    return obj
