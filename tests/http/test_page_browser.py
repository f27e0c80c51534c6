"""The page at `/` in a real headless browser (Debian's chromium through its chromedriver,
driven by selenium; nothing is downloaded): a greedy chat answer streamed into the page
equals `colibri ask`'s, Stop ends an answer and frees the daemon, JSON output holds the
answer to JSON, switching profile redraws the heat map and its pin marks, and the page
fits a narrow window. Screenshots are kept in the test's tmp dir. Skips with the reason
where no browser is installed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from daemon_helpers import Home, serving_http

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="no headless browser: install Debian's chromium and chromium-driver",
)
PROMPT = "What is the capital of France?"
MAX_TOKENS = 24
# chromium without anything that reaches beyond this machine (the test is offline)
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)


@pytest.fixture(scope="module")
def home(demo_container: Path, tmp_path_factory) -> Iterator[Home]:
    yield from serving_http(
        tmp_path_factory.mktemp("page-browser"),
        demo_container,
        # the tiered store (4 experts per layer cached, the rest read from disk) pinning
        # every expert the active profile used: a profile switch moves real pins
        cache=4,
        pin="all",
    )


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[webdriver.Chrome]:
    options = Options()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.add_argument("--window-size=1280,1000")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def status(home: Home) -> dict:
    r = home.colibri("ps", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait(driver, predicate, timeout_s: float = 240):  # noqa: ANN001, ANN201
    return WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(lambda d: predicate(d))


def heat(driver) -> dict:  # noqa: ANN001
    table = driver.find_element(By.ID, "heat")
    return {
        "profile": table.get_attribute("data-profile"),
        "total": int(table.get_attribute("data-total") or -1),
        "pinned": int(table.get_attribute("data-pinned") or -1),
        "cells": len(table.find_elements(By.CSS_SELECTOR, "td")),
        "marked": len(table.find_elements(By.CSS_SELECTOR, "td.pinned")),
    }


def open_page(driver, home: Home) -> None:  # noqa: ANN001
    driver.get(home.url + "/")
    wait(driver, lambda d: d.find_element(By.ID, "model").get_attribute("value") == "demo")
    wait(driver, lambda d: heat(d)["cells"] > 0)  # the first poll came back


def chat(driver, prompt: str, max_tokens: int) -> None:  # noqa: ANN001
    for field, value in (("temperature", "0"), ("max-tokens", str(max_tokens))):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    driver.find_element(By.ID, "prompt").send_keys(prompt)
    driver.find_element(By.ID, "send").click()


def test_a_chat_answer_streams_into_the_page_as_colibri_ask_gives_it(
    browser, home: Home, tmp_path: Path
) -> None:
    asked = home.colibri(
        "ask",
        "--repeat-penalty",
        "1",
        "--temperature",
        "0",
        "--max-tokens",
        str(MAX_TOKENS),
        PROMPT,
        timeout=300,
    )
    assert asked.returncode == 0, asked.stderr
    open_page(browser, home)
    # the model list is the daemon's installed models, the loaded one chosen
    choices = Select(browser.find_element(By.ID, "model")).options
    with httpx.Client(base_url=home.url, timeout=60) as client:
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert [o.get_attribute("value") for o in choices] == ids
    chat(browser, PROMPT, MAX_TOKENS)
    answer = wait(
        browser,
        lambda d: next(
            iter(d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-state='done']")), False
        ),
    )
    text = answer.find_element(By.CSS_SELECTOR, ".text").text
    assert text == asked.stdout.strip() and text
    assert answer.get_attribute("data-finish") in ("stop", "length")
    assert browser.find_element(By.ID, "chat-error").text == ""
    browser.save_screenshot(str(tmp_path / "chat.png"))
    # the tiers panel says how close the answer came to this machine's limits, as STATUS
    # (and the answer's DONE line) has it
    assert wait(browser, lambda d: shows_last_roofline(d, home))


def shows_last_roofline(driver, home: Home) -> bool:  # noqa: ANN001
    with httpx.Client(base_url=home.url, timeout=60) as client:
        last = client.get("/colibri/status").json()["status"]["roofline"]["last"]
    if last is None:
        return False
    said = f"{100 * last['roofline_share']:.1f}% of the roofline ({last['bound']}-bound)"
    text = driver.find_element(By.ID, "figures").text
    kernels = f"kernels {100 * last['kernel_share']:.1f}%"  # the CPU backend's arithmetic
    return said in text and kernels in text and " tok/s" in text


def test_stop_ends_the_answer_and_frees_the_daemon(browser, home: Home) -> None:
    open_page(browser, home)
    browser.find_element(By.ID, "clear").click()
    # the demo loops on this prompt without a repeat penalty: it would run to the limit
    chat(browser, "Tell me about the history of Paris.", 2000)
    wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant .text").text != "")
    browser.find_element(By.ID, "stop").click()
    answer = wait(
        browser,
        lambda d: next(
            iter(d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-state='stopped']")), False
        ),
    )
    assert answer.find_element(By.CSS_SELECTOR, ".text").text.endswith("[stopped]")
    wait(browser, lambda d: status(home)["running"] == 0, timeout_s=60)


def test_switching_profile_redraws_the_heat_map_and_the_pins(
    browser, home: Home, tmp_path: Path
) -> None:
    # a profile that has counted one decode step (top-4 of each layer's 16 experts: decode
    # steps are what a profile counts), and an empty one made active (as `colibri profile
    # use empty --create` would)
    asked = home.colibri("ask", "--profile", "short", "--max-tokens", "2", "Hi", timeout=300)
    assert asked.returncode == 0, asked.stderr
    with httpx.Client(base_url=home.url, timeout=60) as client:
        r = client.post("/colibri/profile", json={"name": "empty", "create": True})
        assert r.status_code == 200 and r.json() == {"profile": "empty"}, r.text
    open_page(browser, home)
    wait(browser, lambda d: heat(d)["profile"] == "empty")
    before = heat(browser)
    # `pin = "all"` with nothing learned pins the first experts that fit; P marks them
    assert before["total"] == 0
    assert before["pinned"] == len(status(home)["pinned"]) == before["marked"] > 0
    Select(browser.find_element(By.ID, "profile")).select_by_value("short")
    browser.find_element(By.ID, "use-profile").click()
    wait(browser, lambda d: heat(d)["profile"] == "short")
    after = heat(browser)
    used = browser.execute_script(
        "return [...document.querySelectorAll('#heat td')]"
        ".filter((td) => td.dataset.count !== '0').length"
    )
    assert 0 < used < after["cells"] == before["cells"] and after["total"] > 0
    # the pins are now the profile's used experts, exactly the cells with a count
    now = status(home)
    assert now["profile"] == "short" and len(now["pinned"]) == used
    assert after["pinned"] == after["marked"] == used != before["pinned"]
    assert browser.execute_script(
        "return [...document.querySelectorAll('#heat td.pinned')]"
        ".every((td) => td.dataset.count !== '0')"
    )
    # the figures beside the map say the same, in words
    figures = browser.find_element(By.ID, "figures").text
    assert "Profile\nshort" in figures or "Profile short" in figures
    assert f"Pinned in RAM\n{used} experts" in figures or f"Pinned in RAM {used}" in figures
    assert browser.find_element(By.ID, "tiers-error").text == ""
    browser.find_element(By.ID, "tiers").screenshot(str(tmp_path / "tiers.png"))


def test_the_page_fits_a_narrow_window(browser, home: Home, tmp_path: Path) -> None:
    browser.set_window_size(400, 900)
    try:
        open_page(browser, home)
        overflow = browser.execute_script(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0  # the heat map scrolls inside its own box, the page does not
        browser.save_screenshot(str(tmp_path / "narrow.png"))
    finally:
        browser.set_window_size(1280, 1000)


def test_json_output_holds_the_answer_to_json(browser, home: Home) -> None:
    """The demo answers this in prose; with the box ticked the grammar holds it to JSON."""
    open_page(browser, home)
    browser.find_element(By.ID, "clear").click()
    box = browser.find_element(By.ID, "json-mode")
    box.click()
    try:
        chat(browser, "Give the capital of France and its country as JSON.", 200)
        answer = wait(
            browser,
            lambda d: next(
                iter(d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-state='done']")), False
            ),
        )
        text = answer.find_element(By.CSS_SELECTOR, ".text").text
        assert answer.get_attribute("data-finish") == "stop"
        assert isinstance(json.loads(text), dict)
    finally:
        box.click()
