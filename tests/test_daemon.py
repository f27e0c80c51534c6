"""The real daemon, started with its own commands on the tiny chat model, and the real
clients: ask (arguments, stdin, both, --json), concurrent streams, cancel in prefill and
decode, a client killed mid-stream, stop while requests run, kill -9 and a stale socket,
a second start, malformed frames by the thousand."""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from colibri_protocol.messages import Data, Done, Submit
from daemon_helpers import Home, alive, wait_for

from colibri_cli.client import Client

sys.path.insert(0, str(Path(__file__).resolve().parent / "fuzz"))


@pytest.fixture(scope="module")
def home(chat_model: Path, tmp_path_factory) -> Home:
    h = Home(
        tmp_path_factory.mktemp("d"),
        chat_model,
        debug_layer_delay_s=0.003,
        shutdown_grace_s=1.0,
        profile_save_s=0.5,
    )
    h.start()
    yield h
    h.close()


def running(home: Home) -> int:
    with Client.connect(home.socket, timeout_s=10) as client:
        return client.query("STATUS")["running"]


def test_start_layout_status_and_second_start(home: Home) -> None:
    assert stat.S_IMODE(home.socket.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(home.socket.stat().st_mode) == 0o600
    assert home.colibrid("status").returncode == 0
    again = home.colibrid("start")
    assert again.returncode == 1 and "already running" in again.stderr
    assert alive(home.pid())


def test_ask_with_arguments_stdin_and_both(home: Home) -> None:
    args = home.colibri("ask", "--max-tokens", "8", "What", "is", "the", "capital?")
    stdin = home.colibri("ask", "--max-tokens", "8", stdin="What is the capital?")
    assert args.returncode == stdin.returncode == 0, args.stderr + stdin.stderr
    assert args.stdout == stdin.stdout and args.stdout.strip()
    both = home.colibri("ask", "--max-tokens", "8", "-v", "summarise this", stdin="notes\n")
    assert both.returncode == 0 and "prompt" in both.stderr and "tok/s" in both.stderr
    plain = home.colibri("ask", "--max-tokens", "8", "summarise this\n\nnotes\n")
    assert both.stdout == plain.stdout


def test_ask_json_lines(home: Home) -> None:
    result = home.colibri(
        "ask",
        "--json",
        "--max-tokens",
        "6",
        "--temperature",
        "0.8",
        "--seed",
        "3",
        "--top-p",
        "0.9",
        "hello",
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[-1]["done"] and lines[-1]["generated_tokens"] == 6
    assert all("text" in line for line in lines[:-1])
    again = home.colibri(
        "ask",
        "--json",
        "--max-tokens",
        "6",
        "--temperature",
        "0.8",
        "--seed",
        "3",
        "--top-p",
        "0.9",
        "hello",
    )
    assert [x.get("text") for x in map(json.loads, again.stdout.splitlines())] == [
        x.get("text") for x in lines
    ]
    done = lines[-1]  # the same kind of field, the same JSON type (they used to be strings)
    assert isinstance(done["cached"], int) and isinstance(done["prefill_s"], float)
    assert isinstance(done["decode_tok_s"], float) and isinstance(done["finish"], str)


def test_status_speculation_values_are_numbers(home: Home) -> None:
    """STATUS's `speculation` (and `colibri ps --json`) used to carry DONE's text values
    ("3", "1.50"): counts are integers and rates numbers now, the same values as the
    request's own DONE, and `colibri ps` still renders them."""
    asked = home.colibri(
        "ask", "--json", "--speculate", "ngram", "--max-tokens", "12", "--temperature", "0",
        "the cat the cat the cat the cat",
    )  # fmt: skip
    assert asked.returncode == 0, asked.stderr
    done = json.loads(asked.stdout.splitlines()[-1])
    spec = json.loads(home.colibri("ps", "--json").stdout)["speculation"]
    assert spec["spec"] == "ngram"
    for key in ("drafted", "accepted", "verifies"):
        assert type(spec[key]) is int, (key, spec)
    for key in ("depth", "gain_predicted", "gain"):
        assert key not in spec or type(spec[key]) is float, (key, spec)
    assert spec == {key: done[key] for key in spec}, (spec, done)  # what DONE said, typed
    assert "speculate: " in home.colibri("ps").stdout


def test_help_shows_defaults_and_versions_answer(home: Home) -> None:
    helptext = home.colibri("ask", "--help").stdout
    assert "default 256" in helptext and "default 0" in helptext
    for line in helptext.splitlines():  # every flag says what it does
        if line.strip().startswith("--") and len(line.split()) <= 2:
            nxt = helptext.splitlines()[helptext.splitlines().index(line) + 1]
            assert nxt.startswith(" " * 10), f"no help text for {line.strip()}"
    assert home.colibrid("--version").stdout.startswith("colibrid ")
    assert home.colibri("--version").stdout.startswith("colibri ")


def test_a_stdin_wait_announces_itself_on_a_terminal(home: Home) -> None:
    """`sleep 8 | colibri ask hi` used to wait without a word: with a terminal on stderr
    (a pty here) the wait for stdin is announced, and the answer still comes."""
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "colibri_cli", "ask", "--max-tokens", "2", "hi"],
            env=home.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=follower,
        )
        time.sleep(1.5)
        said = os.read(leader, 4096).decode(errors="replace")
        out, _ = proc.communicate(b"and more\n", timeout=120)
    finally:
        os.close(leader)
        os.close(follower)
    assert "reading the rest of the prompt from stdin" in said
    assert proc.returncode == 0 and out.strip()


def test_ask_errors_exit_nonzero(home: Home) -> None:
    bad = home.colibri("ask", "--temperature", "-1", "hi")
    assert bad.returncode == 1 and "BAD_REQUEST" in bad.stderr
    other = home.colibri("ask", "--model", "elsewhere", "hi")
    assert other.returncode == 1 and "NOT_FOUND" in other.stderr and "colibri list" in other.stderr


def test_two_clients_stream_interleaved(home: Home) -> None:
    arrivals: dict[str, list[float]] = {"A": [], "B": []}

    def client(name: str) -> None:
        with Client.connect(home.socket, timeout_s=60) as c:
            for event in c.generate(Submit(name, prompt=f"{name} Paris", max_tokens=60)):
                if isinstance(event, Data):
                    arrivals[name].append(time.monotonic())

    threads = [threading.Thread(target=client, args=(n,)) for n in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    a, b = arrivals["A"], arrivals["B"]
    assert a and b
    assert a[0] < b[-1] and b[0] < a[-1]  # each streamed while the other did


def test_ctrl_c_cancels_during_decode_and_engine_is_free(home: Home) -> None:
    proc = home.popen_colibri("ask", "--max-tokens", "240", "tell me everything")
    assert proc.stdout.read(1)  # the answer is streaming
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130
    assert b"cancelled" in proc.stderr.read()
    assert time.monotonic() - t0 < 1.5  # far less than the 240-token answer
    assert running(home) == 0
    after = home.colibri("ask", "--max-tokens", "3", "next")
    assert after.returncode == 0 and after.stdout.strip()


def test_client_killed_mid_stream(home: Home) -> None:
    proc = home.popen_colibri("ask", "--max-tokens", "240", "a long answer please")
    assert proc.stdout.read(1)
    proc.kill()
    proc.wait(10)
    assert wait_for(lambda: running(home) == 0, timeout_s=2.0)
    assert home.colibri("ask", "--max-tokens", "2", "still there?").returncode == 0


def test_random_frames_at_the_real_daemon(home: Home) -> None:
    from test_serve_fuzz import random_frame

    rng = random.Random(7)
    with Client.connect(home.socket, timeout_s=60) as client:
        client.send(b"".join(random_frame(rng) for _ in range(2000)) + b"\n" * 80 + b"PING\n")
        for response in client.responses():
            if getattr(response, "kind", None) == "PONG":
                break
            assert getattr(response, "code", None) != "INTERNAL"
    ok = home.colibri("ask", "--max-tokens", "2", "fine?")
    assert ok.returncode == 0, ok.stderr


def test_a_session_typed_by_hand(home: Home) -> None:
    """As in SERVE.md: a person types into socat, a few characters at a time."""
    import socket

    typed = b"hello 1\nSUBMIT q1 5 max_tokens=3\nParis\nfrobnicate\nPING\n"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(home.socket))
    sock.settimeout(30)
    for i in range(0, len(typed), 3):
        sock.sendall(typed[i : i + 3])
        time.sleep(0.002)
    got = b""
    while b"PONG\n" not in got or b"DONE q1" not in got:  # PING may overtake the answer
        got += sock.recv(65536)
    sock.close()
    text = got.decode()
    assert text.startswith("HELLO 1 colibrid/")
    assert "ACCEPT q1 " in text and "DONE q1 STAT 3 " in text
    assert "ERROR - UNKNOWN_VERB unknown verb 'FROBNICATE'" in text


def test_conversation_turn_reuses_kv(home: Home) -> None:
    with Client.connect(home.socket, timeout_s=60) as client:
        first = list(client.generate(Submit("t1", prompt="Paris is", max_tokens=5, conv="chat")))
        text = "".join(e.text for e in first if isinstance(e, Data))
        second = list(
            client.generate(
                Submit("t2", prompt="Paris is" + text + " and", max_tokens=2, conv="chat")
            )
        )
    done = second[-1]
    assert isinstance(done, Done) and int(done.extras["cached"]) >= 3


def test_stop_while_requests_run_then_stale_socket_after_kill(home: Home) -> None:
    proc = home.popen_colibri("ask", "--max-tokens", "240", "keep talking")
    assert proc.stdout.read(1)
    stopped = home.colibrid("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert proc.wait(30) in (0, 1)  # finished within the grace, or cancelled
    assert not home.socket.exists() and not home.pidfile.exists()
    assert "profiles saved" in home.log()
    # a crashed daemon leaves its socket and pidfile; the next start cleans them
    home.start()
    pid = home.pid()
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: not alive(pid))
    assert home.socket.exists()
    assert home.colibri("ps").returncode == 1
    home.start()
    assert home.colibri("ask", "--max-tokens", "2", "back").returncode == 0


def test_cancel_during_prefill(chat_model: Path, tmp_path_factory) -> None:
    slow = Home(tmp_path_factory.mktemp("p"), chat_model, debug_layer_delay_s=0.15)
    slow.start()
    try:
        with Client.connect(slow.socket, timeout_s=30) as client:
            events = client.generate(Submit("p1", prompt="a prompt to prefill", max_tokens=50))
            next(events)  # ACCEPT: sent before the prefill starts
            t0 = time.monotonic()
            client.send(b"CANCEL p1\n")
            with pytest.raises(Exception, match="CANCELLED: cancelled after 0 generated"):
                list(events)
            assert time.monotonic() - t0 < 0.45  # within a layer, not the 3-layer prefill
            done = list(client.generate(Submit("p2", prompt="next", max_tokens=1)))
            assert isinstance(done[-1], Done)
    finally:
        slow.close()


def test_long_prefill_reports_progress_to_every_front_end(
    chat_model: Path, tmp_path_factory
) -> None:
    """A prefill longer than a second sends PROGRESS over SERVE, an SSE comment in an
    OpenAI stream and a ping in an Anthropic one; the clients read through them."""
    import anthropic
    import httpx
    import openai
    from colibri_protocol.messages import Progress
    from daemon_helpers import free_port

    port = free_port()
    slow = Home(
        tmp_path_factory.mktemp("g"),
        chat_model,
        debug_layer_delay_s=0.6,
        http=f"127.0.0.1:{port}",
        prompt_cache=False,
    )  # 3 layers: ~1.8 s each pass
    slow.start()
    try:
        with Client.connect(slow.socket, timeout_s=30) as client:
            got = list(client.generate(Submit("g1", prompt="a prompt", max_tokens=1)))
        kinds = [type(e).__name__ for e in got]
        assert kinds[:2] == ["Accept", "Progress"] and kinds[-1] == "Done"  # in the prefill
        progress = [e for e in got if isinstance(e, Progress)]
        assert all(0 < p.done < p.total == 3 for p in progress), progress
        body = {
            "model": "model",
            "stream": True,
            "max_tokens": 1,
            "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}],
        }
        raw = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60).text
        assert raw.index(": prefill ") < raw.index('"finish_reason": "length"')
        oai = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60
        )
        chunks = list(oai.chat.completions.create(**{**body, "model": "model"}))
        assert chunks[-1].choices[0].finish_reason == "length"
        claude = anthropic.Anthropic(
            base_url=f"http://127.0.0.1:{port}", api_key="x", max_retries=0
        )
        with claude.messages.stream(
            model="model", max_tokens=1, messages=body["messages"], extra_body={"temperature": 0}
        ) as stream:
            assert stream.get_final_message().stop_reason == "max_tokens"
        raw = httpx.post(f"http://127.0.0.1:{port}/v1/messages", json=body, timeout=60).text
        assert raw.index("event: ping") < raw.index("event: message_stop")
    finally:
        slow.close()


def test_prompt_cache_survives_a_restart(chat_model: Path, tmp_path_factory) -> None:
    home = Home(tmp_path_factory.mktemp("k"), chat_model, shutdown_grace_s=1.0)
    home.start()
    try:
        ask = (
            "ask",
            "--json",
            "--temperature",
            "0.8",
            "--seed",
            "5",
            "--max-tokens",
            "4",
            "Tell me about rivers",
        )

        def answer() -> tuple[str, dict]:
            result = home.colibri(*ask)
            assert result.returncode == 0, result.stderr
            lines = [json.loads(x) for x in result.stdout.splitlines()]
            return "".join(x.get("text", "") for x in lines), lines[-1]

        first, done = answer()
        assert done["cached"] == 0
        assert home.colibrid("stop").returncode == 0
        assert "prompt cache: 1 session(s) kept" in home.log()
        home.start()
        again, done = answer()
        assert (again, done["cached"]) == (first, done["prompt_tokens"])
        # a damaged file costs a warning and nothing else
        saved = next((home.path / "kv").rglob("0.npz"))
        assert stat.S_IMODE(saved.stat().st_mode) == 0o600  # the prompts are private
        assert stat.S_IMODE(saved.parent.stat().st_mode) == 0o700
        assert home.colibrid("stop").returncode == 0
        saved.write_bytes(b"damaged")
        home.start()
        assert answer()[0] == first
        assert "kept KV" in home.log() and "not used" in home.log()
    finally:
        home.close()


def test_ask_starts_a_daemon_or_says_how(chat_model: Path, tmp_path_factory) -> None:
    fresh = Home(tmp_path_factory.mktemp("a"), chat_model)
    (fresh.path / "config.toml").write_text("")
    fresh.env["COLIBRI_NO_PULL"] = "1"  # no demo pull here (tests/demo covers it)
    try:
        none = fresh.colibri("ask", "hi")
        assert none.returncode == 1 and "default_model" in none.stderr
        assert "colibri pull demo" in none.stderr
        auto = fresh.colibri("ask", "--model", str(chat_model), "--max-tokens", "2", "hi")
        assert auto.returncode == 0, auto.stderr
        assert "no daemon running; starting one" in auto.stderr
    finally:
        fresh.close()


def test_concurrent_auto_starts_converge_on_one_daemon(chat_model: Path, tmp_path_factory) -> None:
    """Two asks with no daemon running, and an ask while `colibrid start` is still loading:
    each used to fail with 'could not start the daemon: colibrid is already running'. They
    wait for the daemon that is starting and answer."""
    home = Home(tmp_path_factory.mktemp("race"), chat_model, debug_layer_delay_s=0.0)
    try:
        asks = [home.popen_colibri("ask", "--max-tokens", "2", f"q{k}") for k in range(3)]
        outs = [p.communicate(timeout=180) for p in asks]
        for p, (out, err) in zip(asks, outs, strict=True):
            assert p.returncode == 0, err.decode()
            assert out.strip(), err.decode()
        pid = home.pid()
        home.close()
        starting = subprocess.Popen(
            [sys.executable, "-m", "colibrid", "start"],
            env=home.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        time.sleep(0.3)
        late = home.colibri("ask", "--max-tokens", "2", "hi", timeout=180)
        starting.communicate(timeout=180)
        assert late.returncode == 0, late.stderr
        assert starting.returncode == 0 and home.pid() not in (None, pid)
    finally:
        home.close()


def test_done_names_the_stop_string_that_ended_the_answer(home: Home) -> None:
    """DONE carries the stop string that matched (percent-encoded as SUBMIT's option), so
    a SERVE client knows which of its stop strings ended the answer; none when none did."""
    with Client.connect(home.socket, timeout_s=60) as client:
        plain = list(client.generate(Submit("s0", prompt="Paris is", max_tokens=12, temperature=0)))
        text = "".join(e.text for e in plain if isinstance(e, Data))
        assert isinstance(plain[-1], Done) and plain[-1].stop_string is None
        assert "stop" not in plain[-1].extras
        assert len(text) >= 6
        cut = len(text) // 3
        stop = text[cut : cut + 3]  # text the answer will reach (it may hold a space)
        stopped = list(
            client.generate(
                Submit("s1", prompt="Paris is", max_tokens=12, temperature=0, stop=("%zz 9", stop))
            )
        )
    done = stopped[-1]
    assert isinstance(done, Done) and done.finish == "stop"
    assert done.stop_string == stop
    assert "".join(e.text for e in stopped if isinstance(e, Data)) == text[: text.index(stop)]
