"""Conformance transcripts (see SERVE.md, "Conformance vectors") and their loader."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DIR = Path(__file__).resolve().parent


@dataclass
class Vector:
    name: str
    steps: list[tuple[str, str]] = field(default_factory=list)  # ("send"|"expect", text)
    expect_text: dict[str, str] = field(default_factory=dict)
    client_only: bool = False

    def server_bytes(self) -> bytes:
        """The daemon's side made concrete (wildcards filled in) for client tests."""
        out = []
        for kind, text in self.steps:
            if kind != "expect":
                continue
            words = [w if w != "*" else "0" for w in text.removesuffix(" ...").split(" ")]
            if words[0] == "DONE":
                words += ["0"] * (8 - len(words)) if len(words) < 8 else []
            out.append(" ".join(words) if " " in text else text)
        return ("\n".join(out) + "\n").encode("utf-8")


def matches(pattern: str, line: str) -> bool:
    """`*` matches one word; a trailing ` ...` matches the rest of the line."""
    rest = pattern.endswith(" ...")
    want = pattern.removesuffix(" ...").split(" ")
    got = line.split(" ")
    if "*" not in want and not rest:
        return pattern == line
    if len(got) < len(want) or (not rest and len(got) != len(want)):
        return False
    for i, w in enumerate(want):
        last = rest and i == len(want) - 1
        if w == "*":
            continue
        if last and not got[i].startswith(w):
            return False
        if not last and got[i] != w:
            return False
    return True


def load(path: Path) -> Vector:
    vector = Vector(path.stem)
    for raw in path.read_text(encoding="utf-8").splitlines():
        if raw.startswith("# expect-text "):
            rid, _, text = raw[len("# expect-text ") :].partition(": ")
            vector.expect_text[rid] = text
        elif raw.strip() == "# side: client":
            vector.client_only = True
        elif raw.startswith(">") or raw.startswith("<"):
            text = raw[2:] if raw[1:2] == " " else raw[1:]
            vector.steps.append(("send" if raw[0] == ">" else "expect", text))
    return vector


def all_vectors() -> list[Vector]:
    return [load(p) for p in sorted(DIR.glob("*.txt"))]
