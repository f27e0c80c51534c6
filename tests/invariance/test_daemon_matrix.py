"""Placement never changes tokens — through the real daemon (docs/architecture.md).

Each cell starts `colibrid start` in a private $COLIBRI_HOME with the placement settings
users combine (config.toml `cache`, `pilot`, `direct`, `ram_gb`; speculative decoding at its
default, `auto`), sends every prompt — and one JSON-schema constrained request — through the
SERVE client (`colibri ask`) and the HTTP API (the official `openai` client against
`--http`) at the same time, greedy (so the requests are decoded together, batched), and
compares each answer byte for byte with the answer of the plain run: the resident store (the
same model in a daemon with no placement key: its experts stay resident), speculation off,
one request at a time. A cell then changes the active profile while the daemon serves
(`colibri profile use code`, and back to `default`) and asks again. Profiles:

* ``empty``: a fresh home; the daemon itself warms `code` (`colibri profile warm code`)
  before `profile use code`;
* ``warmed``: the home starts with the profiles the resident daemon left behind
  (`default.coli_usage` with its asks' counts, `code.coli_usage` from `profile warm code`),
  which is what makes the daemon pin experts at start.

``colibrid generate --ids ... --ids-out`` with ``--pin auto|all`` (plus ``--cache``,
``--profile``) is compared the same way with the resident `colibrid generate` run.

Models: the demo (tests/conftest.py `demo_container`) and tiny random checkpoints of the
other families (GLM-5 `glm_moe_dsa`, `deepseek_v3`, `qwen3_moe`, `mixtral`, `olmoe`)
converted to int4 containers by `colibri convert`, whose experts the tiered store streams
(tests/invariance/conftest.py).
`prompt_cache = false` in every home: a request continued from a kept session may differ
from a cold one in the last bits (README), which is not a placement effect.

MEMWATCH from outside: the watcher shrinks the cache while the daemon's RSS exceeds the
RAM budget (`rss_cap` = `ram_gb`), so a `ram_gb` just above the dense weights, with an
explicit `cache`, makes it shrink on the first tokens; the cell checks `STATUS` reports the
shrink. There is no hook to shrink at a chosen moment (mid-session, between two asks):
that needs a test-only knob, e.g. a `debug_memwatch_available` setting (or a SERVE
`DEBUG MEMWATCH <bytes>` line) that overrides `MemWatch.available`, which product code
does not have today.

Running it:

* default (CI, `pytest -q`): the demo with `--cache 2`, a warmed profile and `profile use`
  switching, SERVE and HTTP at once; tiny GLM-5, Qwen3-MoE and gpt-oss with MXFP4 experts
  kept at 4 bits streamed the same way;
  `colibrid generate --pin auto|all` on tiny GLM-5. Alone:
  ``pytest -q tests/invariance/test_daemon_matrix.py``.
* the full matrix (marker `matrix`, skipped by default): models {demo, glm_moe_dsa,
  deepseek_v32, deepseek_v3, qwen3_moe, mixtral, olmoe, gpt_oss} x cache {1, 2, 8} x PILOT
  {on, off} x O_DIRECT {on, off} x profile {empty, warmed}, MEMWATCH shrink cells, and the
  `colibrid generate` pin matrix:
  ``COLIBRI_MATRIX=1 pytest -q tests/invariance/test_daemon_matrix.py`` (or
  ``pytest -q -m matrix tests/invariance``).
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_helpers import Home, free_port
from matrix_support import (
    BATCH_ROUNDS,
    QUERIES,
    SETTINGS,
    Reference,
    ask_all,
    copy_profiles,
    generate_ids,
    matrix_model,
    status,
)

KINDS = (
    "demo",
    "gpt_oss_fp4",
    "glm_moe_dsa",
    "deepseek_v32",
    "deepseek_v3",
    "qwen3_moe",
    "mixtral",
    "olmoe",
    "gpt_oss",
)


@dataclass(frozen=True)
class Cell:
    kind: str
    cache: int
    profile: str = "warmed"  # "empty" | "warmed"
    pilot: str | None = None  # None: the daemon's default (auto: on when streaming)
    direct: bool | None = None  # None: the default (on)
    ram_gb: float | None = None  # a budget below the daemon's RSS: MEMWATCH shrinks

    def __str__(self) -> str:
        parts = [self.kind, f"cache{self.cache}", self.profile]
        if self.pilot is not None:
            parts.append(f"pilot-{self.pilot}")
        if self.direct is not None:
            parts.append(f"direct-{'on' if self.direct else 'off'}")
        if self.ram_gb is not None:
            parts.append(f"memwatch(ram_gb={self.ram_gb})")
        return "-".join(parts)


def compare(phase: str, ref: Reference, got: tuple[dict[str, str], dict[str, str]]) -> list[str]:
    out = []
    for client, want, have in (("SERVE", ref.serve, got[0]), ("HTTP", ref.http, got[1])):
        for prompt in QUERIES:
            if have[prompt] != want[prompt]:
                out.append(
                    f"[{phase}] {client} {prompt!r}\n"
                    f"    resident: {want[prompt]!r}\n"
                    f"    daemon:   {have[prompt]!r}"
                )
    return out


def pins_within_capacity(when: str, st: dict) -> list[str]:
    """`colibri ps` data: pins never exceed what the plan reserved, and the hit rate shows."""
    ram = st["tiers"]["ram"]
    if len(st["pinned"]) != ram["pinned"] or ram["pinned"] > ram["pin_capacity"]:
        return [f"[{when}] pins outside the plan: {ram}"]
    return []


def concurrent_rounds(
    home: Home, port: int, name: str, ref: Reference, profile: str
) -> tuple[list[str], int]:
    """Rounds of every query through SERVE and HTTP at once, each held to the reference,
    until two asks shared a pass (on a loaded machine a round of fast asks can each finish
    before the next arrives): (problems, rounds asked)."""
    problems = compare(f"start, {profile} profile", ref, ask_all(home, port, name))
    rounds = 1
    while rounds < BATCH_ROUNDS and not status(home)["shared_passes"]:
        rounds += 1
        problems += compare(f"start, round {rounds}", ref, ask_all(home, port, name))
    return problems, rounds


def run_cell(request: pytest.FixtureRequest, reference, tmp_path: Path, cell: Cell) -> None:
    model = matrix_model(request, cell.kind)
    ref = reference(model)
    if cell.profile == "warmed":
        copy_profiles(ref, tmp_path / "home", hottest_quarter=cell.kind != "demo")
    port = free_port()
    settings: dict[str, object] = dict(SETTINGS, http=str(port), cache=cell.cache)
    if cell.pilot is not None:
        settings["pilot"] = cell.pilot
    if cell.direct is not None:
        settings["direct"] = cell.direct
    if cell.ram_gb is not None:
        settings["ram_gb"] = cell.ram_gb
    if cell.kind != "demo" and cell.profile == "warmed":
        settings["pin"] = "all"  # a tiny model's history stays below AUTOPIN's 5,000 selections
    home = Home(tmp_path / "home", model.path, **settings)
    problems: list[str] = []
    asked = 0
    final: dict = {}
    try:
        home.start()
        st = status(home)
        assert st["tiers"]["disk"]["experts"] > 0, f"{cell}: experts not streamed: {st['tiers']}"
        room = st["tiers"]["ram"]["pin_capacity"]  # a tight budget leaves no pin room
        if cell.profile == "warmed" and room and not st["pinned"]:
            problems.append(f"[start] a warmed profile pinned nothing: {st['tiers']}")
        problems += pins_within_capacity("start", st)
        found, rounds = concurrent_rounds(home, port, model.name, ref, cell.profile)
        problems += found
        asked += rounds * 2 * len(QUERIES)
        batched = status(home)
        if not batched["shared_passes"] or batched["speculate"] != "auto":
            problems.append(f"[start] not batched or not speculating: {batched}")
        if cell.ram_gb is not None:
            note = status(home)["tiers"].get("store", {}).get("memwatch", "")
            if "shrink" not in note:
                problems.append(f"[memwatch] no shrink happened (memwatch: {note!r})")
        if cell.profile == "empty":
            warm = home.colibri("profile", "warm", "code", "--limit", "2", "--max-tokens", "6")
            if warm.returncode != 0:
                problems.append(f"[profile warm code] rc={warm.returncode}: {warm.stderr[-400:]}")
        switches = ["code"] + (["default"] if cell.profile == "warmed" else [])
        for name in switches:
            use = home.colibri("profile", "use", name)
            if use.returncode != 0:
                problems.append(f"[profile use {name}] rc={use.returncode}: {use.stderr[-400:]}")
            problems += compare(f"after `profile use {name}`", ref, ask_all(home, port, model.name))
            problems += pins_within_capacity(f"profile use {name}", status(home))
            asked += 2 * len(QUERIES)
        final = status(home)["tiers"]
    finally:
        home.close()
    assert not problems, (
        f"{cell}: {len(problems)} problem(s) over {asked} greedy answers compared with the "
        f"resident store's:\n"
        + "\n".join(problems)
        + f"\n-- final STATUS tiers: {final}"
        + f"\n-- colibrid.log (tail):\n{home.log()[-1500:]}"
    )


@dataclass(frozen=True)
class GenCell:
    kind: str
    pin: str  # auto | all
    cache: int | None = None
    profile: bool = True  # --profile: a copy of the resident daemon's default.coli_usage
    pilot: str | None = None

    def flags(self, tmp_path: Path, ref: Reference) -> list[str]:
        flags = ["--pin", self.pin]
        if self.cache is not None:
            flags += ["--cache", str(self.cache)]
        if self.pilot is not None:
            flags += ["--pilot", self.pilot]
        if self.profile:  # generate writes the profile back: never the reference's own file
            path = tmp_path / "default.coli_usage"
            shutil.copy(ref.profiles / "default.coli_usage", path)
            flags += ["--profile", str(path)]
        return flags

    def __str__(self) -> str:
        parts = [self.kind, f"pin-{self.pin}", f"cache{self.cache}" if self.cache else "budget"]
        parts += ["warmed" if self.profile else "empty"]
        return "-".join(parts + ([f"pilot-{self.pilot}"] if self.pilot else []))


def run_generate(request, reference, tmp_path: Path, cells: list[GenCell]) -> None:
    problems = []
    for cell in cells:
        model = matrix_model(request, cell.kind)
        ref = reference(model)
        flags = cell.flags(tmp_path, ref)
        got = generate_ids(model.path, ref.ids, *flags)
        if got != ref.generated:
            problems.append(
                f"[{cell}] colibrid generate {' '.join(flags)}\n"
                f"    resident: {ref.generated!r}\n    tiered:   {got!r}"
            )
    assert not problems, (
        f"{len(problems)} of {len(cells)} `colibrid generate --ids-out` runs differ from the "
        "resident store's:\n" + "\n".join(problems)
    )


# ---- default part (CI) ---------------------------------------------------------------------
def test_demo_cache2_warmed_profile_use_serve_and_http(request, reference, tmp_path) -> None:
    """The issue-12 reproduction: demo, `--cache 2`, a warmed profile, `profile use`."""
    run_cell(request, reference, tmp_path, Cell("demo", 2, "warmed"))


def test_glm5_streamed_cache2_warmed_profile_use(request, reference, tmp_path) -> None:
    run_cell(request, reference, tmp_path, Cell("glm_moe_dsa", 2, "warmed"))


def test_qwen3_streamed_cache2_warmed_profile_use(request, reference, tmp_path) -> None:
    """A softmax-routed family (qk-norm, no shared expert) streamed the way users run it."""
    run_cell(request, reference, tmp_path, Cell("qwen3_moe", 2, "warmed"))


def test_gpt_oss_fp4_streamed_cache2_warmed_profile_use(request, reference, tmp_path) -> None:
    """gpt-oss with its MXFP4 experts kept at 4 bits (FP4), streamed: the resident text."""
    run_cell(request, reference, tmp_path, Cell("gpt_oss_fp4", 2))


def test_generate_pin_auto_and_all_glm5(request, reference, tmp_path) -> None:
    run_generate(
        request,
        reference,
        tmp_path,
        [GenCell("glm_moe_dsa", "auto"), GenCell("glm_moe_dsa", "all", cache=2)],
    )


# ---- the full matrix (opt-in: COLIBRI_MATRIX=1 or -m matrix) -------------------------------
MATRIX = [
    Cell(kind, cache, profile, pilot, direct)
    for kind, cache, pilot, direct, profile in itertools.product(
        KINDS, (1, 2, 8), ("on", "off"), (True, False), ("empty", "warmed")
    )
]
MEMWATCH = [
    Cell("demo", 8, "warmed", ram_gb=0.2),
    Cell("demo", 2, "empty", ram_gb=0.2),
    Cell("glm_moe_dsa", 8, "warmed", ram_gb=0.05),
    Cell("deepseek_v3", 8, "warmed", ram_gb=0.05),
]
GENERATE = {
    kind: [
        GenCell(kind, pin, cache, profile, pilot)
        for pin, cache, profile in itertools.product(
            ("auto", "all"), (None, 1, 2, 8), (False, True)
        )
        for pilot in (("on", "off") if cache == 2 else (None,))
    ]
    for kind in KINDS
}


@pytest.mark.matrix
@pytest.mark.parametrize("cell", MATRIX + MEMWATCH, ids=str)
def test_matrix_daemon(request, reference, tmp_path, cell: Cell) -> None:
    run_cell(request, reference, tmp_path, cell)


@pytest.mark.matrix
@pytest.mark.parametrize("kind", KINDS)
def test_matrix_generate_pin(request, reference, tmp_path, kind: str) -> None:
    run_generate(request, reference, tmp_path, GENERATE[kind])
