"""Profiles end to end on the real daemon: warm a domain, list it, draw it, switch to it
at run time: the pinned set (in `colibri ps`) changes, no token of a greedy answer does."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from colibri_protocol.codec import encode_line
from daemon_helpers import Home

from colibri_cli.client import Client


@pytest.fixture(scope="module", params=["resident", "tiered"])
def home(request, chat_model: Path, tmp_path_factory) -> Home:
    """The daemon with experts resident (nothing to pin: every expert is in RAM), and with
    the tiered store (`cache = 4`, `pin = "all"` in config.toml: a tiny model's history
    stays below AUTOPIN's 5,000 selections), where pins really move experts."""
    settings = {"cache": 4, "pin": "all"} if request.param == "tiered" else {}
    h = Home(tmp_path_factory.mktemp("prof"), chat_model, **settings)
    h.start()
    yield h
    h.close()


def used_experts(client: Client, profile: str) -> list[list[int]]:
    """[layer, expert] of every expert the profile has counted, sorted."""
    body = client.call(encode_line("PROFILE", "SHOW", profile), want=("PROFILE",))
    return sorted(
        [layer, e]
        for layer, row in zip(body["layers"], body["counts"], strict=True)
        for e, n in enumerate(row)
        if n > 0
    )


def pinned(home: Home) -> list:
    result = home.colibri("ps", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["pinned"]


def test_warm_list_show_use_save(home: Home, tmp_path: Path) -> None:
    question = ("ask", "--max-tokens", "16", "What is the capital of France?")
    before = home.colibri(*question)
    assert before.returncode == 0
    warm = home.colibri("profile", "warm", "code", "--limit", "2", "--max-tokens", "8")
    assert warm.returncode == 0, warm.stderr
    listing = home.colibri("profile", "list")
    assert "code" in listing.stdout and "built-in, not warmed" in listing.stdout
    pins_default = pinned(home)
    use = home.colibri("profile", "use", "code")
    assert use.returncode == 0, use.stderr
    assert "pins (" in use.stdout  # the switch says what it did to the pins
    ps = home.colibri("ps")
    assert "code" in ps.stdout and "PINNED" in ps.stdout
    if home.settings.get("cache") is None:  # resident: nothing moves, ps says why
        assert pinned(home) == [] and "every expert is in RAM" in ps.stdout
        assert "every expert is in RAM" in use.stdout
    else:
        # the pins follow the code profile by the store's rule: its used experts, hottest
        # first, within the capacity (here every used expert fits)
        with Client.connect(home.socket, timeout_s=10) as client:
            used = used_experts(client, "code")
        # in place when `profile use` has answered, not some time later: a one-token
        # request counts into a new profile `mine` (a few experts a layer), then on one
        # connection the daemon switches to it and back, the status asked for at once
        one = home.colibri("ask", "--raw", "--profile", "mine", "--max-tokens", "1", "a")
        assert one.returncode == 0, one.stderr
        with Client.connect(home.socket, timeout_s=10) as client:
            mine = used_experts(client, "mine")
            assert mine and mine != used
            client.call(encode_line("PROFILE", "USE", "mine"), want=("OK",))
            assert sorted(client.query("STATUS")["pinned"]) == mine
            client.call(encode_line("PROFILE", "USE", "code"), want=("OK",))
            assert sorted(client.query("STATUS")["pinned"]) == used
        assert used and sorted(pinned(home)) == used, (
            pins_default,
            pinned(home),
            used,
        )
        status = json.loads(home.colibri("ps", "--json").stdout)
        ram = status["tiers"]["ram"]
        assert (
            0 < ram["pinned"] <= ram["pin_capacity"] and "pins (all)" in home.colibri("ps").stdout
        )
    after = home.colibri(*question)
    assert after.stdout == before.stdout  # placement never changes tokens
    png = tmp_path / "code.png"
    show = home.colibri("profile", "show", "code", "--png", str(png))
    assert show.returncode == 0, show.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 0 and height > 0
    saved = home.colibri("profile", "save", "mine")
    assert saved.returncode == 0 and "mine.coli_usage" in saved.stdout
    usage = Path(saved.stdout.split()[-1]).read_text().splitlines()
    assert usage[0].startswith("-1 ") and usage[1].startswith("-2 ")
    assert all(len(line.split()) == 3 for line in usage)
    missing = home.colibri("profile", "show", "nope")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    assert "colibri profile warm nope" in missing.stderr, "a hint, not only NOT_FOUND"
    assert "--profile nope" in missing.stderr and "{" not in missing.stderr  # filled in


def test_use_refuses_an_unknown_profile_and_the_choice_survives_a_restart(
    chat_model: Path, tmp_path: Path
) -> None:
    """`profile use nosuch` used to exit 0 and silently make an empty profile active; and
    the active profile was forgotten when the daemon restarted."""
    h = Home(tmp_path / "home", chat_model)
    try:
        h.start()
        nosuch = h.colibri("profile", "use", "nosuch")
        assert nosuch.returncode == 1 and "NOT_FOUND" in nosuch.stderr
        assert "--create" in nosuch.stderr and "profile warm nosuch" in nosuch.stderr
        assert json.loads(h.colibri("ps", "--json").stdout)["profile"] == "default"
        made = h.colibri("profile", "use", "mine", "--create")
        assert made.returncode == 0, made.stderr
        assert json.loads(h.colibri("ps", "--json").stdout)["profile"] == "mine"
        h.close()
        h.start()
        assert json.loads(h.colibri("ps", "--json").stdout)["profile"] == "mine"
    finally:
        h.close()


def test_the_heat_map_is_labelled(tmp_path: Path) -> None:
    """Axes (layers down, experts across), tick labels, a colour bar and a title: dark
    label pixels around the grid, the bar's colours right of it."""
    from PIL import Image

    from colibri_cli.png import MARGIN_LEFT, MARGIN_TOP, color, write_heatmap

    counts = [[(3 * layer + e) % 7 for e in range(16)] for layer in range(4)]
    path = tmp_path / "heat.png"
    width, height = write_heatmap(path, counts, layers=[1, 2, 3, 4], title="profile x of m")
    image = Image.open(path).convert("RGB")
    assert image.size == (width, height)

    def dark(box: tuple[int, int, int, int]) -> int:
        region = list(image.crop(box).get_flattened_data())
        return sum(1 for r, g, b in region if r + g + b < 200)

    assert dark((0, 0, width, MARGIN_TOP - 4)) > 20, "a title"
    assert dark((0, MARGIN_TOP, MARGIN_LEFT - 6, height - 40)) > 20, "layer labels"
    assert dark((MARGIN_LEFT, height - 40, width - 100, height)) > 20, "expert labels"
    right = list(image.crop((width - 100, MARGIN_TOP, width, height - 44)).get_flattened_data())
    assert color(1.0) in set(right) and color(0.0) in set(right), "a colour bar"
