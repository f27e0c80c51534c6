"""The page at `/` and its JSON endpoints over real HTTP (httpx) on the real daemon: the
files are served with their content types and a CSP that allows nothing from elsewhere;
the Host/Origin gate covers them; `GET /colibri/status` is the STATUS `colibri ps --json`
prints plus the active profile's counts; `POST /colibri/profile` does what `colibri
profile use` does, and refuses what it cannot honour in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from colibri_protocol.codec import encode_line
from daemon_helpers import Home, free_port, serving_http

from colibri_cli.client import Client

MODEL = "model"  # the chat_model fixture's directory name
# STATUS fields that do not move while the daemon is idle (uptime, RSS and keep-alive
# countdowns do, so they are compared by presence only)
STEADY = (
    "model",
    "backend",
    "plan",
    "profile",
    "tiers",
    "hit_rate",
    "pinned",
    "last_tok_s",
    "requests_done",
    "queued",
    "running",
    "http",
)


@pytest.fixture(scope="module")
def home(chat_model: Path, tmp_path_factory):
    yield from serving_http(tmp_path_factory.mktemp("page"), chat_model)


@pytest.fixture(scope="module")
def http(home):
    with httpx.Client(base_url=home.url, timeout=60) as client:
        # one answer first, so the profile has counts and the tiers have lookups
        r = client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hello there"}],
                "max_tokens": 8,
                "temperature": 0,
            },
        )
        assert r.status_code == 200, r.text
        yield client


def ps(home) -> dict:
    r = home.colibri("ps", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def profile_counts(home, name: str) -> dict:
    with Client.connect(home.socket, timeout_s=30) as client:
        return client.call(encode_line("PROFILE", "SHOW", name), want=("PROFILE",))


def test_the_page_and_its_files(http) -> None:
    page = http.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert page.headers["x-frame-options"] == "DENY"
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(assets) == ["/page/app.js", "/page/style.css"]
    kinds = {"/page/app.js": "text/javascript", "/page/style.css": "text/css"}
    for path in assets:
        r = http.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kinds[path])
        assert r.headers["x-content-type-options"] == "nosniff"
        # nothing is fetched from another site: no absolute URL anywhere in the page
        assert not re.search(r"https?://", r.text), path
    assert not re.search(r"https?://", page.text)
    assert http.get("/page/nope.js").status_code == 404
    assert http.post("/", json={}).status_code == 405


def test_the_gate_covers_the_page_and_its_endpoints(http, home) -> None:
    before = http.get("/colibri/status").json()["status"]["profile"]
    for path in ("/", "/page/app.js", "/colibri/status"):
        r = http.get(path, headers={"host": "attacker.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    foreign = http.post(
        "/colibri/profile",
        json={"name": "forged", "create": True},
        headers={"origin": "http://attacker.example"},
    )
    assert foreign.status_code == 403
    assert foreign.json()["error"]["code"] == "origin_not_allowed"
    # a form or text/plain POST (no CORS preflight) is refused before it is read
    plain = http.post(
        "/colibri/profile",
        content=json.dumps({"name": "forged", "create": True}),
        headers={"content-type": "text/plain"},
    )
    assert plain.status_code == 415
    # this machine's own page may post
    ours = http.post("/colibri/profile", json={"name": before}, headers={"origin": home.url})
    assert ours.status_code == 200 and ours.json() == {"profile": before}
    names = [p["name"] for p in http.get("/colibri/status").json()["profiles"]]
    assert "forged" not in names and ps(home)["profile"] == before


def test_status_is_what_colibri_ps_shows(http, home) -> None:
    snap = http.get("/colibri/status")
    assert snap.status_code == 200 and snap.headers["content-type"] == "application/json"
    body = snap.json()
    shown = ps(home)
    assert set(body["status"]) == set(shown)
    for key in STEADY:
        assert body["status"][key] == shown[key], key
    assert body["status"]["requests_done"] >= 1 and body["status"]["model"] == MODEL
    # the heat map is the active profile's counts, as `colibri profile show` reads them
    heat = body["heat"]
    saved = profile_counts(home, shown["profile"])
    assert heat["profile"] == shown["profile"]
    assert heat["layers"] == saved["layers"] and heat["counts"] == saved["counts"]
    assert sum(map(sum, heat["counts"])) > 0  # the answer above was counted
    listed = {p["name"]: p for p in body["profiles"]}
    assert listed[shown["profile"]]["active"] is True


def test_switching_profile_changes_what_status_reports(http, home) -> None:
    first = http.get("/colibri/status").json()
    original = first["status"]["profile"]
    r = http.post("/colibri/profile", json={"name": "fresh", "create": True})
    assert r.status_code == 200 and r.json() == {"profile": "fresh"}
    now = http.get("/colibri/status").json()
    assert now["status"]["profile"] == "fresh" == ps(home)["profile"]
    assert now["heat"]["profile"] == "fresh"
    assert sum(map(sum, now["heat"]["counts"])) == 0  # an empty profile
    # back: the original counts are shown again (nothing counted meanwhile)
    assert http.post("/colibri/profile", json={"name": original}).status_code == 200
    again = http.get("/colibri/status").json()
    assert again["status"]["profile"] == original == ps(home)["profile"]
    assert again["heat"]["counts"] == first["heat"]["counts"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"name": "no-such-profile"}, 404, "name"),  # `profile use` without --create
        ({"name": "a b"}, 400, "name"),
        ({"name": 3}, 400, "name"),
        ({}, 400, "name"),
        ({"name": "x", "create": "yes"}, 400, "create"),
        ({"name": "x", "pin": True}, 400, "pin"),
        (["x"], 400, None),
    ],
)
def test_a_bad_profile_request_is_refused_and_changes_nothing(
    http, home, body, status, param
) -> None:
    before = ps(home)["profile"]
    r = http.post("/colibri/profile", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and "\n" not in error["message"]
    assert ps(home)["profile"] == before
    assert "x" not in [p["name"] for p in http.get("/colibri/status").json()["profiles"]]


def test_start_gives_the_page_which_loads_without_the_key_and_the_data_needs_it(
    chat_model: Path, tmp_path_factory
) -> None:
    """`colibrid start` prints the page's address. Off-loopback a key guards the API; the
    page's files carry no data and a browser cannot attach a key to a page load, so they
    are served without one."""
    port = free_port()
    h = Home(
        tmp_path_factory.mktemp("page-key"),
        chat_model,
        http=f"127.0.0.1:{port}",
        http_api_key="sesame",
        shutdown_grace_s=1.0,
    )
    started = h.colibrid("start")
    try:
        assert started.returncode == 0, started.stderr
        # `colibrid start` says where the page is
        line = f"in a browser: http://127.0.0.1:{port}/"
        assert line in started.stdout.splitlines()[-1], started.stdout
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            assert client.get("/").status_code == 200
            assert client.get("/page/app.js").status_code == 200
            assert client.get("/colibri/status").status_code == 401
            assert client.post("/colibri/profile", json={"name": "x"}).status_code == 401
            keyed = client.get("/colibri/status", headers={"authorization": "Bearer sesame"})
            assert keyed.status_code == 200 and keyed.json()["status"]["model"] == MODEL
    finally:
        h.close()
