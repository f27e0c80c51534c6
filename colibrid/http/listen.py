"""The HTTP API's listening sockets, bound by the daemon before it loads the model.

Hypercorn binds inside its own nursery, so a taken port reached the user as "Exceptions
from Trio nursery" above sixty lines of traceback, and only after the model had loaded
(minutes, for a large one). Binding here first, with hypercorn's own socket code, turns
that into one line naming the address, before anything slow; hypercorn then serves the
bound sockets (`fd://`), so what it listens on is exactly what was checked.
"""

from __future__ import annotations

import errno
import socket
from typing import Any

from hypercorn.config import Config

from colibrid.errors import ConfigError
from colibrid.http.app import parse_bind


def bind_http(settings: Any) -> list[socket.socket]:
    """Bind `settings.http` (refusing a non-loopback address without a key, as
    `parse_bind` does); not listening yet, so a client is refused, not queued, while the
    model loads. An address that cannot be bound is one ConfigError line."""
    config = Config()
    address = parse_bind(settings.http, settings.http_api_key)
    config.bind = [address]
    try:
        return config.create_sockets().insecure_sockets
    except OSError as exc:
        hint = ""
        if exc.errno == errno.EADDRINUSE:
            hint = " (another program listens there: pick another port with --http or "
            hint += "config.toml key `http`)"
        raise ConfigError(
            f"cannot listen on {address} for the HTTP API: {exc.strerror or exc}{hint}"
        ) from None


def fd_binds(sockets: list[socket.socket]) -> list[str]:
    """Hypercorn `bind` entries handing it the sockets: each descriptor becomes
    hypercorn's to close (detached here, so nothing closes it twice)."""
    return [f"fd://{sock.detach()}" for sock in sockets]
