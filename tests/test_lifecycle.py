"""Model lifecycle as a user drives it, on the real daemon with the settings a user turns on
together (experts streamed through a small cache, PILOT, HTTP beside the socket):
pull a checkpoint folder and a container, list, run, switch models on request (SERVE and
HTTP), stop, keep_alive, rm, logs. Every answer is compared with the plain resident run
(`colibrid generate`) of the same model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_helpers import Home, free_port, wait_for
from interrupt_helpers import KILL_IN_SECOND_SHARD

PROMPT = "Tell me about the sea"
TOKENS = "12"
# the chat commands repeat-penalise by default; the reference is the plain greedy run
PLAIN = ("--repeat-penalty", "1")


@pytest.fixture
def home(tmp_path: Path, demo_container: Path):
    port = free_port()
    h = Home(
        tmp_path / "home",
        Path("demo"),
        cache=2,
        pilot="on",
        keep_alive=600,
        http=f"127.0.0.1:{port}",
    )
    h.port = port  # type: ignore[attr-defined]
    h.env["COLIBRI_NO_PULL"] = "1"
    linked = h.colibri("pull", str(demo_container), "--name", "demo")
    assert linked.returncode == 0, linked.stderr
    yield h
    h.close()


def resident(home: Home, model: str) -> str:
    """The plain run: one process, every expert resident, no daemon."""
    done = home.colibrid(
        "generate", "--model", model, "--prompt", PROMPT, "--max-tokens", TOKENS, "--pin", "all"
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def status(home: Home) -> dict:
    done = home.colibri("ps", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def listed(home: Home) -> dict[str, dict]:
    done = home.colibri("list", "--json")
    assert done.returncode == 0, done.stderr
    return {row["name"]: row for row in map(json.loads, done.stdout.splitlines())}


def test_pull_list_run_switch_stop_keep_alive_rm(
    home: Home, chat_model: Path, demo_container: Path
) -> None:
    pulled = home.colibri("pull", str(chat_model), "--name", "t1")
    assert pulled.returncode == 0, pulled.stderr
    assert "t1: installed at" in pulled.stdout
    models = listed(home)
    assert set(models) == {"demo", "t1"} and models["demo"]["linked"]
    assert models["t1"]["arch"] == "glm4_moe" and models["t1"]["size_bytes"] > 0
    want_t1, want_demo = resident(home, "t1"), resident(home, "demo")
    assert want_t1 != want_demo

    # `run NAME PROMPT` in a pipe: starts the daemon, loads t1, one answer
    ran = home.colibri("run", "t1", PROMPT, "--max-tokens", TOKENS, *PLAIN, stdin="")
    assert ran.returncode == 0, ran.stderr + home.log()
    assert ran.stdout == want_t1
    assert status(home)["model"] == "t1"
    assert listed(home)["t1"]["loaded"].startswith("loaded")

    refused = home.colibri("rm", "t1")
    assert refused.returncode == 1 and "--force" in refused.stderr
    assert (home.path / "models" / "t1").is_dir()

    # a request naming another installed model loads it (the daemon is idle)
    asked = home.colibri("ask", "--model", "demo", "--max-tokens", TOKENS, *PLAIN, PROMPT)
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout == want_demo, asked.stderr + home.log()
    before = status(home)
    assert before["model"] == "demo" and before["unload_in_s"] is not None

    # over HTTP, with the official client: models listed, a switch back, keep_alive 0
    from openai import OpenAI

    api = OpenAI(base_url=f"http://127.0.0.1:{home.port}/v1", api_key="none")  # type: ignore[attr-defined]
    assert {m.id for m in api.models.list().data} >= {"demo", "t1"}
    reply = api.chat.completions.create(
        model="t1",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=int(TOKENS),
        temperature=0,
        extra_body={"keep_alive": 0},
    )
    assert reply.model == "t1" and reply.choices[0].message.content + "\n" == want_t1
    assert wait_for(lambda: status(home)["model"] is None, timeout_s=15)

    # stop: the model goes, the daemon stays; the next request loads one again
    asked = home.colibri("ask", "--model", "demo", "--max-tokens", TOKENS, *PLAIN, PROMPT)
    assert asked.stdout == want_demo, asked.stderr + home.log()
    loaded = status(home)
    assert loaded["model"] == "demo"  # one request's keep_alive 0 did not outlive it
    stopped = home.colibri("stop")
    assert stopped.returncode == 0, stopped.stderr
    unloaded = status(home)
    assert unloaded["model"] is None and unloaded["pid"] == loaded["pid"]
    assert unloaded["rss_gb"] < loaded["rss_gb"]
    assert "none loaded" in home.colibri("ps").stdout

    # keep_alive 0 from the socket client: unloaded right after the answer. No model
    # named: the daemon's own (`run t1` started it with t1)
    asked = home.colibri("ask", "--max-tokens", TOKENS, "--keep-alive", "0", *PLAIN, PROMPT)
    assert asked.stdout == want_t1, asked.stderr + home.log()
    assert wait_for(lambda: status(home)["model"] is None, timeout_s=15)

    removed = home.colibri("rm", "t1")
    assert removed.returncode == 0, removed.stderr
    assert set(listed(home)) == {"demo"} and not (home.path / "models" / "t1").exists()

    # --force unloads first; a linked model loses its link, never the folder it points to
    assert home.colibri("run", "demo", PROMPT, "--max-tokens", "2", stdin="").returncode == 0
    forced = home.colibri("rm", "demo", "--force")
    assert forced.returncode == 0, forced.stderr
    assert status(home)["model"] is None and listed(home) == {}
    assert (demo_container / "manifest.json").is_file()

    log = home.colibri("logs", "-n", "200").stdout
    assert "loaded t1" in log and "loaded demo" in log and "unloaded" in log
    assert sum("request " in line for line in log.splitlines()) >= 5


def test_a_name_it_cannot_fetch_is_one_line(home: Home) -> None:
    done = home.colibri("pull", "llama3")
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert "offline" in done.stderr or "fetches no model registry" in done.stderr


def test_a_missing_path_is_no_such_file_or_folder(home: Home) -> None:
    """A path that does not exist is named as missing, not as something colibri cannot
    fetch from a registry (which the user never asked for)."""
    for missing in ("/nonexistent/dir", "./not-here", "~/not-here-either", "SmolLM2.gguf"):
        done = home.colibri("pull", missing)
        assert done.returncode == 1, done.stderr
        assert done.stderr == f"colibri pull: error: {missing}: no such file or folder\n"


def test_a_folder_without_tokenizer_json_is_refused_before_converting(
    home: Home, oracle_checkpoint, tmp_path: Path
) -> None:
    """It used to convert, install and then fail at the first question: refused in one
    line naming what to do, with nothing installed; --no-tokenizer installs it anyway for
    token-id prompts, which then run."""
    folder = tmp_path / "hf"
    shutil.copytree(oracle_checkpoint("glm4_moe").out_dir, folder)  # no tokenizer.json
    refused = home.colibri("pull", str(folder), "--name", "notok")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"{folder}: no tokenizer.json" in refused.stderr and "--no-tokenizer" in refused.stderr
    assert "notok" not in listed(home)
    assert not list((home.path / "models").glob(".notok*"))  # nothing half-converted
    (folder / "tokenizer.model").write_bytes(b"sentencepiece")
    hinted = home.colibri("pull", str(folder), "--name", "notok")
    assert hinted.returncode == 1 and "save_pretrained" in hinted.stderr, hinted.stderr
    ids_only = home.colibri("pull", str(folder), "--name", "notok", "--no-tokenizer", "--quiet")
    assert ids_only.returncode == 0, ids_only.stderr
    answer = home.colibrid(
        "generate", "--model", "notok", "--ids", "1,2,3", "--ids-out", "--max-tokens", "3"
    )
    assert answer.returncode == 0 and answer.stdout.count(",") == 2, answer.stderr


def test_pull_a_gguf_and_the_names_it_refuses(home: Home, demo_gguf: Path, chat_model: Path):
    pulled = home.colibri("pull", str(demo_gguf), "--name", "smol", "--quiet")
    assert pulled.returncode == 0, pulled.stderr
    row = listed(home)["smol"]
    assert row["arch"] == "glm4_moe" and not row["linked"]
    answer = home.colibrid("generate", "--model", "smol", "--prompt", "hi", "--max-tokens", "4")
    assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr

    taken = home.colibri("pull", str(chat_model), "--name", "smol")
    assert taken.returncode == 1 and "colibri rm smol" in taken.stderr
    assert listed(home)["smol"]["arch"] == "glm4_moe"  # untouched
    for bad in ("../evil", ".hidden", "a/b"):
        refused = home.colibri("pull", str(chat_model), "--name", bad)
        assert refused.returncode == 1 and "cannot be a model name" in refused.stderr
    assert set(listed(home)) == {"demo", "smol"}
    replaced = home.colibri("pull", str(chat_model), "--name", "smol", "--force", "--quiet")
    assert replaced.returncode == 0, replaced.stderr
    assert listed(home)["smol"]["size_bytes"] < row["size_bytes"]


def test_an_interrupted_pull_resumes(home: Home, chat_model: Path) -> None:
    args = ["pull", str(chat_model), "--name", "t2", "--shard-gb", "0.0003", "--quiet"]
    killed = subprocess.run(
        [sys.executable, "-c", KILL_IN_SECOND_SHARD, *args],
        env=home.env,
        capture_output=True,
        text=True,
    )
    assert killed.returncode == 137, killed.stderr
    partial = home.path / "models" / ".t2.partial"
    assert list(partial.glob(".*.partial")) and "t2" not in listed(home)
    resumed = home.colibri(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert "t2" in listed(home) and not partial.exists()
    answer = home.colibrid("generate", "--model", "t2", "--prompt", "hi", "--max-tokens", "3")
    assert answer.returncode == 0, answer.stderr
