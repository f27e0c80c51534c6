"""`colibri stop [NAME]`: unload the model the daemon serves; the daemon stays, and the
next request (or `colibri run NAME`) loads a model again. `colibrid stop` ends the daemon."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from colibri_protocol.codec import encode_line

from colibri_cli.client import Client, ClientError, NotRunning


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri stop", description=__doc__)
    p.add_argument("name", nargs="?", metavar="NAME", help="only if this model is the loaded one")
    return p


def unload(client: Client, name: str | None) -> str | None:
    """Unload (only `name`, when given); the unloaded model's name, None if none was."""
    status = client.query("STATUS")
    loaded = status.get("model") if isinstance(status, dict) else None
    if loaded is None:
        return None
    if name is not None and name != loaded:
        raise ClientError(f"{name} is not loaded (the daemon serves {loaded})")
    try:
        args = client.call(encode_line("UNLOAD"), want=("OK",))
    except ClientError as exc:
        if exc.code == "NO_MODEL":  # unloaded meanwhile (keep_alive)
            return None
        raise
    return str(args[1]) if len(args) > 1 else loaded


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        with Client.connect(timeout_s=600) as client:
            name = unload(client, args.name)
    except NotRunning:
        print("colibri stop: no daemon is running; nothing is loaded")
        return 0
    except ClientError as exc:
        print(f"colibri stop: {exc}", file=sys.stderr)
        return 1
    if name is None:
        print("no model is loaded")
    else:
        print(f"unloaded {name} (the daemon stays; the next request loads a model again)")
    return 0
