"""Which browsers may reach the API: the Host, Origin and Content-Type rules.

Why: binding 127.0.0.1 keeps other machines out, not the web pages open in this machine's
browser. Any page may send a CORS "simple request" (a POST with ``text/plain``, no
preflight) to 127.0.0.1, which would start a generation; with DNS rebinding
(``attacker.example`` re-resolving to 127.0.0.1) the browser even lets the page read the
answers and /metrics, since it believes it talks to attacker.example. Three checks close
this without a key:

- ``Host`` must name the loopback (DNS rebinding always carries the attacker's name);
- ``Origin``, which browsers send on cross-origin requests and every POST, must be a
  loopback page's, or one listed in ``http_cors`` when that is set;
- POST bodies must be ``application/json``, which no simple request can send.

With ``http_api_key`` set the key guards the API: any Host is fine (the daemon may sit
behind a proxy or listen on a LAN address) and, unless ``http_cors`` lists origins, so is
any Origin (a page cannot attach the key cross-origin without a preflight, which fails).
Requests without ``Host`` or ``Origin`` (HTTP/1.0, h2c, plain clients) never come from a
browser page and pass.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from colibrid.http.errors import ApiError

LOOPBACK_NAMES = frozenset({"localhost"})


def split_host(value: str) -> str | None:
    """The host of a ``Host`` header (``name``, ``name:port``, ``[v6]``, ``[v6]:port``),
    lower-cased and without brackets; None when the value is malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or (rest and not (rest[:1] == ":" and rest[1:].isdigit())):
            return None
        return host
    host, sep, port = value.partition(":")
    if sep and not port.isdigit():
        return None
    return host or None


def is_loopback_host(host: str, bound: str | None = None) -> bool:
    """`host` (no port, no brackets) names this machine: ``localhost``, a loopback IP
    literal, or the loopback name the listener was bound to. No DNS lookup: a name that
    merely resolves to 127.0.0.1 today is exactly what DNS rebinding looks like."""
    if host in LOOPBACK_NAMES or (bound is not None and host == bound):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_origin(origin: str, bound: str | None = None) -> bool:
    """``http(s)://`` + a loopback host (+ a port), nothing else (``null`` is not)."""
    try:
        parts = urlsplit(origin)
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or parts.path or parts.query or parts.username:
        return False
    return parts.hostname is not None and is_loopback_host(parts.hostname, bound)


class Gate:
    """The Host and Origin rules of one listener (see the module docstring)."""

    def __init__(self, *, keyed: bool, cors: list[str], bound: str | None) -> None:
        self.keyed = keyed
        self.cors = cors
        self.bound = bound.strip("[]").lower() if bound else None

    def check(self, headers: dict[bytes, bytes]) -> None:
        """Raises a 403 `ApiError` for a request a browser page could have forged."""
        host = headers.get(b"host")
        if not self.keyed and host is not None:
            name = split_host(host.decode("latin-1"))
            if name is None or not is_loopback_host(name, self.bound):
                raise ApiError(
                    403,
                    f"Host {host.decode('latin-1')[:100]!r} is not this machine: without "
                    "http_api_key the API answers only requests addressed to localhost, "
                    "127.0.0.1 or [::1] (this stops DNS-rebinding web pages)",
                    code="host_not_allowed",
                )
        origin = headers.get(b"origin")
        if origin is None:
            return
        text = origin.decode("latin-1")
        if self.cors:
            allowed = "*" in self.cors or text in self.cors
            rule = "is not listed in http_cors"
        else:
            allowed = self.keyed or is_loopback_origin(text, self.bound)
            rule = "is not a page on this machine and http_cors is not set"
        if not allowed:
            raise ApiError(
                403,
                f"Origin {text[:100]!r} {rule}: browser pages from other sites may not use "
                "this API",
                code="origin_not_allowed",
            )


def require_json(headers: dict[bytes, bytes]) -> None:
    """POST bodies are JSON and say so; anything else is refused before it is read (a
    ``text/plain`` or form POST is what a page sends to skip the CORS preflight)."""
    given = headers.get(b"content-type", b"").decode("latin-1")
    if given.split(";", 1)[0].strip().lower() != "application/json":
        shown = f"{given[:100]!r}" if given else "no content-type"
        raise ApiError(
            415,
            f"the body must be JSON sent as `content-type: application/json` (got {shown})",
            code="unsupported_media_type",
        )
