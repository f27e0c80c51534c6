"""`colibri list`: the installed models, their size and number formats, and which one the
daemon has loaded (asked of a running daemon; none is started for it). A remote model
(`colibri pull URL`) shows as `remote`, with its endpoint's URL (never its key)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from colibri_cli.client import ClientError, daemon_status
from colibri_cli.render import duration, table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri list", description=__doc__)
    p.add_argument("--json", action="store_true", help="one JSON object per model")
    return p


def loaded_note(name: str, status: dict[str, Any] | None) -> str:
    """What the daemon does with `name`: loaded (and until when), loading, or nothing."""
    if status is None:
        return ""
    if status.get("loading") == name:
        return "loading"
    if status.get("model") != name:
        return ""
    unload_in = status.get("unload_in_s")
    return "loaded" if unload_in is None else f"loaded (unloads in {duration(unload_in)})"


def remote_note(name: str, status: dict[str, Any] | None) -> str:
    """What the daemon does with the remote model `name`: its requests running now."""
    used = ((status or {}).get("remote") or {}).get(name)
    return f"{used['running']} running" if used and used.get("running") else ""


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    from colibrid.installed import installed
    from colibrid.paths import Paths

    paths = Paths.from_env(None)
    models = installed(paths)
    try:
        status = daemon_status()
    except ClientError as exc:  # a daemon that does not answer: the list still shows
        print(f"colibri list: the daemon did not say what is loaded ({exc})", file=sys.stderr)
        status = None
    if args.json:
        for m in models:
            row = {
                "name": m.name,
                "arch": m.model_type,
                "size_bytes": m.size_bytes,
                "quantisation": m.quantisation,
                "path": str(m.path),
                "linked": m.linked,
                "loaded": loaded_note(m.name, status),
                "remote": None
                if m.remote is None
                else {"url": m.remote.url, "model": m.remote.model},
            }
            print(json.dumps(row))
        return 0
    if not models:
        print(f"no models in {paths.models} (`colibri pull demo` installs the demo model)")
        return 0
    rows: list[list[object]] = [["NAME", "ARCH", "SIZE", "QUANTISATION", "LOADED"]]
    for m in models:
        if m.remote is not None:  # computed elsewhere: nothing here to size or load
            where = f"{m.remote.model} at {m.remote.url}"
            rows.append([m.name, "remote", "-", where, remote_note(m.name, status)])
            continue
        size = (
            f"{m.size_bytes / 1e9:.2f} GB"
            if m.size_bytes >= 1e9
            else f"{m.size_bytes / 1e6:.0f} MB"
        )
        name = f"{m.name} -> {m.path}" if m.linked else m.name
        rows.append([name, m.model_type, size, m.quantisation, loaded_note(m.name, status)])
    print(table(rows))
    return 0
