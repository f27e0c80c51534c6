"""`colibri config`: every key of config.toml with its type, default and meaning, made from
the one definition (`colibrid.config.Settings`), as a table, a commented example file
(`--toml`) or the Markdown of docs/configuration.md (`--markdown`; a test keeps that page
equal to it)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from colibrid.config import FIELDS, Settings
from colibrid.paths import Paths


def _type(annotation: str) -> str:
    kind = annotation.replace(" | None", "")
    return {"str": "string", "int": "integer", "float": "number", "bool": "true/false"}.get(
        kind, kind
    )


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def rows() -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) for every setting, in definition order."""
    defaults = Settings()
    out = []
    for name, f in FIELDS.items():
        value = getattr(defaults, name)
        shown = "unset" if value is None else _toml(value)
        out.append((name, _type(str(f.type)), shown, f.metadata["help"]))
    return out


def markdown() -> str:
    lines = [
        "# Configuration",
        "",
        "`$COLIBRI_HOME/config.toml` (default `~/.colibri/config.toml`) holds these keys; a",
        "key the daemon does not know is an error naming it, so a typo never silently does",
        "nothing. The flags of `colibrid start` and `colibrid run` override the keys of the",
        "same names. `colibri config` prints this table, `colibri config --toml` an example",
        "file with every key commented out. (This page is generated from",
        "`colibrid/config.py`: `colibri config --markdown`.)",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{k}` | {cell(t)} | `{cell(d)}` | {cell(m)} |" for k, t, d, m in rows()]
    return "\n".join(lines) + "\n"


def cell(text: str) -> str:
    """Text inside a Markdown table cell: a `|` (as in `cpu|mlx`) would end the cell."""
    return text.replace("|", "\\|")


def toml_example() -> str:
    out = ["# colibri config.toml: every key, commented out at its default", ""]
    for key, kind, default, meaning in rows():
        out.append(f"# {meaning} ({kind})")
        out.append(f"# {key} = {default if default != 'unset' else '...'}")
        out.append("")
    return "\n".join(out)


def table(current: dict[str, object] | None = None) -> str:
    """Key, default, meaning; with `current` (the file's values) a column of what is set."""
    width = max(len(k) for k in FIELDS)
    lines = []
    for key, kind, default, meaning in rows():
        now = ""
        if current is not None and key in current:
            now = f"  [set: {_toml(current[key])}]"
        lines.append(f"{key:<{width}}  {kind:<10} {default:<12} {meaning}{now}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri config",
        description="Every key of $COLIBRI_HOME/config.toml: type, default, meaning, and "
        "what this home's file sets.",
    )
    form = p.add_mutually_exclusive_group()
    form.add_argument("--toml", action="store_true", help="a commented example config.toml")
    form.add_argument("--markdown", action="store_true", help="the table of docs/configuration.md")
    return p


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    if args.toml:
        print(toml_example())
        return 0
    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    paths = Paths.from_env(None)
    current = None
    if paths.config.is_file():
        from colibrid.config import tomllib

        current = tomllib.loads(paths.config.read_text(encoding="utf-8"))
    print(f"{paths.config}{'' if current is not None else ' (not there: every default)'}")
    print(table(current))
    return 0
