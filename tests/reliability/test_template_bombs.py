"""A model whose chat template is a bomb, through the real daemon and `colibrid generate`.

A template that bombs on every chat is refused when the model loads: `colibrid start`
fails in one line naming the limit, within seconds. A template that bombs only on some
messages costs those requests a TEMPLATE error, promptly; the daemon keeps answering
`ps`, answers other requests as before, and stops within its grace.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from daemon_helpers import GLM_TEMPLATE, Home, alive, wait_for

from colibri_cli.client import Client

BOMB = "{{ 'A' * 4000000000 }}"
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# Bombs only on a marked message: the load-time sample chat does not trigger them.
MARKED = (
    "{% if 'BOOM' in messages[-1]['content'] %}" + BOMB + "{% endif %}"
    "{% if 'SPIN' in messages[-1]['content'] %}" + SPIN + "{% endif %}" + GLM_TEMPLATE
)
ASK = ("ask", "--temperature", "0", "--max-tokens", "6")


def model_with_template(chat_model: Path, where: Path, template: str) -> Path:
    """A copy of the tiny chat model whose tokenizer_config.json has `template`."""
    model = where / "model"
    shutil.copytree(chat_model, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return model


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


@pytest.mark.parametrize(
    ("template", "limit"),
    [(BOMB + GLM_TEMPLATE, "size limit of"), (SPIN + GLM_TEMPLATE, "time limit of 2 s")],
    ids=["repeat", "spin"],
)
def test_start_refuses_a_model_whose_template_always_bombs(
    chat_model: Path, tmp_path: Path, template: str, limit: str
) -> None:
    model = model_with_template(chat_model, tmp_path, template)
    home = Home(tmp_path / "home", model)
    try:
        started = time.monotonic()
        result = home.colibrid("start", timeout=60)
        elapsed = time.monotonic() - started
        assert result.returncode != 0, result.stdout
        line = one_line(result.stderr)
        assert limit in line and str(model) in line and "refused" in line, line
        assert elapsed < 10, elapsed
        assert not home.socket.exists()
        generate = home.colibrid("generate", "--model", str(model), "--prompt", "hi")
        assert generate.returncode == 1
        assert limit in one_line(generate.stderr)
    finally:
        home.close()


def preparing(home: Home) -> int:
    with Client.connect(home.socket, timeout_s=10) as client:
        return client.query("STATUS")["preparing"]


def test_a_template_that_bombs_on_some_messages_costs_those_requests_only(
    chat_model: Path, tmp_path: Path
) -> None:
    model = model_with_template(chat_model, tmp_path, MARKED)
    home = Home(tmp_path / "home", model, shutdown_grace_s=1.0)
    home.start()
    try:
        before = home.colibri(*ASK, "What is the capital?")
        assert before.returncode == 0 and before.stdout.strip(), before.stderr + home.log()

        started = time.monotonic()
        boom = home.colibri(*ASK, "BOOM what is the capital?", timeout=30)
        assert time.monotonic() - started < 5
        assert boom.returncode != 0
        line = one_line(boom.stderr)
        assert "TEMPLATE" in line and "size limit of" in line and str(model) in line, line

        # A render that spins runs in a preparing thread; the event loop still answers.
        spin = home.popen_colibri(*ASK, "SPIN what is the capital?")
        assert wait_for(lambda: preparing(home) >= 1, timeout_s=10)
        started = time.monotonic()
        ps = home.colibri("ps", timeout=10)
        assert ps.returncode == 0 and "MODEL" in ps.stdout, ps.stderr
        assert time.monotonic() - started < 2
        _, err = spin.communicate(timeout=20)
        assert spin.returncode != 0
        line = one_line(err.decode())
        assert "TEMPLATE" in line and "time limit of 2 s" in line, line

        after = home.colibri(*ASK, "What is the capital?")
        assert after.returncode == 0 and after.stdout == before.stdout, after.stderr
        assert home.colibri("ps").returncode == 0

        generate = home.colibrid("generate", "--model", str(model), "--prompt", "BOOM")
        assert generate.returncode == 1 and "size limit of" in one_line(generate.stderr)

        pid = home.pid()
        started = time.monotonic()
        stop = home.colibrid("stop", timeout=30)
        assert stop.returncode == 0, stop.stderr
        assert time.monotonic() - started < 10
        assert pid is not None and wait_for(lambda: not alive(pid), timeout_s=5)
    finally:
        home.close()
