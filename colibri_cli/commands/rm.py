"""`colibri rm NAME`: remove an installed model. A model the daemon has loaded is refused
unless `--force`, which unloads it first. A model installed as a link (a container folder
pulled in place) loses only its link: the folder is the user's. The model's prompt cache
goes with it; its usage profiles are kept (a model pulled again under the name reuses
them). A remote model (`colibri pull URL`) takes the key file its pull stored with it."""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence

from colibri_cli.client import Client, ClientError, NotRunning
from colibri_cli.commands.stop import unload


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri rm", description=__doc__)
    p.add_argument("names", nargs="+", metavar="NAME", help="installed model (`colibri list`)")
    p.add_argument(
        "--force", action="store_true", help="unload the model first if the daemon has it loaded"
    )
    return p


def release(name: str, force: bool) -> None:
    """Make sure the daemon does not serve `name` (unloading it with `force`)."""
    try:
        client = Client.connect(timeout_s=600)
    except NotRunning:
        return
    with client:
        status = client.query("STATUS")
        if name not in (status.get("model"), status.get("loading")):
            return
        if not force:
            raise ClientError(
                f"{name} is loaded in the daemon; `colibri stop` it first, or rm --force"
            )
        unload(client, name)


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    from colibrid.installed import NotInstalled, remove
    from colibrid.paths import Paths

    paths = Paths.from_env(None)
    failed = 0
    for name in args.names:
        try:
            release(name, args.force)
            print(remove(name, paths))
        except (ClientError, NotInstalled, OSError) as exc:
            print(f"colibri rm: {exc}", file=sys.stderr)
            failed = 1
            continue
        shutil.rmtree(paths.kv / name, ignore_errors=True)  # its prompt cache
    return failed
