"""A failed request, a restart or a kill -9 never changes what a later request computes.

Driven through the real daemon on the built-in demo model with its experts streamed
(`cache = 2`, PILOT and pins as a user has them) and compared with a fresh resident
daemon's answer: a request that fails inside its pass (an injected fault, what a failed
read or a kernel bug does), the same prompt again, a restart that restores the prompt
cache, a saved session whose KV was edited (with and without a matching digest), and
kill -9 at random moments while a request runs.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from colibri_protocol.messages import Submit
from daemon_helpers import Home, alive, wait_for

from colibri_cli.client import Client, ClientError
from colibrid.engine import kv_files

PROMPT = "Write a short line about the sea"
ASK = ("ask", "--temperature", "0", "--max-tokens", "12", PROMPT)
MARK = "FAULT-HERE"
KILL_TRIALS = int(os.environ.get("COLIBRI_KILL_TRIALS", "3"))  # the long form: 50 or more
STREAMED = dict(cache=2, shutdown_grace_s=2.0, profile_save_s=0.5)


def answer(home: Home, *args: str) -> str:
    result = home.colibri(*(args or ASK))
    assert result.returncode == 0, result.stderr + home.log()
    return result.stdout


@pytest.fixture(scope="module")
def fresh_answer(demo_container: Path, tmp_path_factory) -> str:
    """What a fresh resident daemon answers (no prompt cache, nothing kept)."""
    home = Home(tmp_path_factory.mktemp("fresh"), demo_container, prompt_cache=False)
    home.start()
    try:
        return answer(home)
    finally:
        home.close()


def test_a_failed_request_then_a_restart_answer_as_a_fresh_daemon(
    demo_container: Path, tmp_path_factory, fresh_answer: str
) -> None:
    home = Home(
        tmp_path_factory.mktemp("failed"),
        demo_container,
        debug_fail_prompt=MARK,
        debug_fail_after=40,  # past the prefill: the fault lands in the decode
        **STREAMED,
    )
    home.start()
    try:
        marked = ("ask", "--temperature", "0", "--max-tokens", "12", f"{PROMPT} {MARK}")
        failed = home.colibri(*marked)
        assert failed.returncode != 0 and "INTERNAL" in failed.stderr, failed.stderr
        assert answer(home) == fresh_answer
        # the marked prompt itself (the fault fires once): its kept KV was given up
        again = home.colibri(*marked)
        assert again.returncode == 0, again.stderr
        assert answer(home) == fresh_answer  # answered from the prompt cache now
        assert home.colibrid("stop").returncode == 0
        home.start()
        assert answer(home) == fresh_answer
    finally:
        home.close()


def _edit_saved_session(kv_dir: Path, *, keep_digest: bool) -> Path:
    """Scale one layer's KV rows of the saved session; with `keep_digest` the digest is
    recomputed, as if the rows had been computed wrongly in the first place."""
    path = next(kv_dir.rglob("0.npz"))
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    name = next(k for k in sorted(arrays) if k.startswith("kv.1."))
    arrays[name] = arrays[name] * np.float32(1.5) + np.float32(0.25)
    if keep_digest:
        arrays["digest"] = np.frombuffer(kv_files.digest(arrays).encode(), dtype=np.uint8)
    with path.open("wb") as handle:
        np.savez(handle, **arrays)
    return path


@pytest.mark.parametrize("keep_digest", [False, True], ids=["digest-breaks", "digest-kept"])
def test_an_edited_saved_session_is_dropped(
    demo_container: Path, tmp_path_factory, fresh_answer: str, keep_digest: bool
) -> None:
    home = Home(tmp_path_factory.mktemp("edited"), demo_container, **STREAMED)
    home.start()
    try:
        assert answer(home) == fresh_answer
        assert home.colibrid("stop").returncode == 0
        _edit_saved_session(home.path / "kv", keep_digest=keep_digest)
        home.start()
        assert answer(home) == fresh_answer
        log = home.log()
        if keep_digest:  # the file is whole: its first use recomputes it and disagrees
            assert "restored prompt-cache session dropped" in log, log
        else:
            assert "do not match their digest" in log, log
    finally:
        home.close()


def test_kill_9_at_random_moments(
    demo_container: Path, tmp_path_factory, fresh_answer: str
) -> None:
    home = Home(tmp_path_factory.mktemp("kill"), demo_container, **STREAMED)
    rng = random.Random(18)
    try:
        for _trial in range(KILL_TRIALS):
            home.start()
            pid = home.pid()
            assert pid is not None
            # a raw client (`colibri ask` would start a new daemon when it finds none)
            with Client.connect(home.socket, timeout_s=30) as client:
                events = client.generate(Submit("k", prompt=PROMPT, max_tokens=64))
                next(events)  # ACCEPT: the request runs
                time.sleep(rng.uniform(0.0, 0.4))
                os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ClientError, OSError):  # or it had just finished
                    list(events)
            assert wait_for(lambda pid=pid: not alive(pid))
            home.start()
            assert answer(home) == fresh_answer
            assert home.colibrid("stop").returncode == 0
        leftovers = [p for p in home.path.rglob("*.tmp")]
        assert not leftovers, leftovers
    finally:
        home.close()
