"""`colibri profile list | show NAME | use NAME | save NAME | warm NAME`.

A profile is the usage history of one domain for the loaded model: which experts each
layer selected, how often. `use` makes it the daemon's active profile (requests without
`--profile` count into it, and the hot set is re-pinned from it while serving goes on);
`warm` sends the domain's built-in prompts so the profile learns the domain; `show`
prints the hottest experts per layer and draws the whole heat map as a PNG.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from colibri_protocol import home
from colibri_protocol.codec import encode_line
from colibri_protocol.messages import Submit

from colibri_cli.client import Client, ClientError, ensure_daemon
from colibri_cli.commands.ps import pins_line
from colibri_cli.render import table


def _builtin_profiles() -> Path:
    """The built-in domain profiles: shipped as the `colibri_profiles` package (the repo's
    profiles/ folder), found beside the sources in a checkout."""
    import importlib.util

    spec = importlib.util.find_spec("colibri_profiles")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if Path(location).is_dir():
                return Path(location)
    return Path(__file__).resolve().parents[2] / "profiles"


BUILTIN = _builtin_profiles()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri profile", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    sub.add_parser("list", help="the loaded model's profiles and the built-in domains")
    show = sub.add_parser("show", help="hottest experts per layer, and a PNG heat map")
    show.add_argument("name")
    show.add_argument("--png", type=Path, metavar="PATH", help="where to write the picture")
    use = sub.add_parser(
        "use", help="make NAME the active profile (re-pins the hot set; kept across restarts)"
    )
    use.add_argument("name")
    use.add_argument(
        "--create", action="store_true", help="start an empty profile when there is none"
    )
    save = sub.add_parser("save", help="save the active profile's history as NAME")
    save.add_argument("name")
    warm = sub.add_parser("warm", help="run the domain's built-in prompts to learn it")
    warm.add_argument("name")
    warm.add_argument("--max-tokens", type=int, default=32, metavar="N")
    warm.add_argument("--limit", type=int, metavar="K", help="only the first K prompts")
    return p


def read_prompt_file(path: Path) -> list[str]:
    """One prompt per line; blank lines and lines starting with # are skipped (the
    warm.txt format, also what `colibri bench replay --prompts` reads)."""
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def warm_prompts(name: str) -> list[str]:
    for folder in (home.colibri_home() / "profiles" / name, BUILTIN / name):
        path = folder / "warm.txt"
        if path.is_file():
            return read_prompt_file(path)
    known = (
        sorted(p.name for p in BUILTIN.iterdir() if (p / "warm.txt").is_file())
        if BUILTIN.is_dir()
        else []
    )
    raise ClientError(
        f"no warm-up prompts for {name!r} (built-in: {', '.join(known)}; your "
        f"own go in {home.colibri_home() / 'profiles' / name / 'warm.txt'})"
    )


def builtin_domains() -> list[str]:
    if not BUILTIN.is_dir():
        return []
    return sorted(p.name for p in BUILTIN.iterdir() if (p / "warm.txt").is_file())


def do_list(client: Client) -> None:
    body = client.call(encode_line("PROFILE", "LIST"), want=("PROFILES",))
    rows = [["NAME", "SELECTIONS", "ACTIVE", "SAVED"]]
    names = set()
    for p in body["profiles"]:
        names.add(p["name"])
        rows.append(
            [p["name"], p["selections"], "*" if p["active"] else "", "yes" if p["saved"] else "no"]
        )
    rows += [[d, "-", "", "built-in, not warmed"] for d in builtin_domains() if d not in names]
    print(f"model {body['model']}\n{table(rows)}")


def do_show(client: Client, name: str, png: Path | None) -> None:
    from colibri_cli.png import write_heatmap

    body = client.call(encode_line("PROFILE", "SHOW", name), want=("PROFILE",))
    counts = body["counts"]
    total = sum(map(sum, counts))
    print(f"profile {name} of {body['model']}: {total} selections")
    for layer, row in zip(body["layers"], counts, strict=True):
        layer_total = sum(row) or 1
        hot = sorted(range(len(row)), key=lambda e: (-row[e], e))[:4]
        hot_text = "  ".join(f"e{e}:{100 * row[e] / layer_total:.0f}%" for e in hot if row[e])
        print(f"  layer {layer:>3}  {hot_text or '(no data)'}")
    path = png or home.colibri_home() / "profiles" / body["model"] / f"{name}.png"
    title = f"profile {name} of {body['model']}: {total} selections"
    width, height = write_heatmap(path, counts, layers=body["layers"], title=title)
    print(f"heat map ({width}x{height}, layers down, experts across, log colour bar): {path}")


def do_warm(client: Client, name: str, max_tokens: int, limit: int | None) -> None:
    prompts = warm_prompts(name)[:limit]
    for i, prompt in enumerate(prompts, 1):
        submit = Submit(
            client.next_id(),
            messages=({"role": "user", "content": prompt},),
            max_tokens=max_tokens,
            profile=name,
        )
        for _ in client.generate(submit):
            pass
        print(
            f"\rcolibri: warming {name}: {i}/{len(prompts)} prompts",
            end="",
            file=sys.stderr,
            flush=True,
        )
    print(file=sys.stderr)
    client.call(encode_line("PROFILE", "FLUSH"), want=("OK",))
    print(f"profile {name} warmed with {len(prompts)} prompts")


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        with ensure_daemon() if args.action == "warm" else Client.connect(timeout_s=60) as client:
            if args.action == "list":
                do_list(client)
            elif args.action == "show":
                do_show(client, args.name, args.png)
            elif args.action == "warm":
                do_warm(client, args.name, args.max_tokens, args.limit)
            else:
                extra = ["CREATE"] if args.action == "use" and args.create else []
                words = client.call(
                    encode_line("PROFILE", args.action.upper(), args.name, *extra), want=("OK",)
                )
                print(f"colibri: {' '.join(words).lower()}")
                if args.action == "use" and (pins := pins_line(client.query("STATUS"))):
                    print(pins)  # what switching did to the pins (in by now)
    except ClientError as exc:
        print(f"colibri profile: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
