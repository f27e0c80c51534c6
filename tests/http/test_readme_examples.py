"""The README's HTTP examples, run as printed (the port swapped for a free one) against a
daemon serving the demo model: the Python block with the official openai client and each
curl line. They once named a model "MODEL" and got 404."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_helpers import Home, free_port

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
PRINTED_ADDRESS = "127.0.0.1:8080"


@pytest.fixture(scope="module")
def address(demo_container: Path, tmp_path_factory):
    port = free_port()
    home = Home(tmp_path_factory.mktemp("readme-http"), demo_container, http=f"127.0.0.1:{port}")
    home.start()
    yield f"127.0.0.1:{port}"
    home.close()


def _http_section() -> str:
    return README.split("## HTTP API", 1)[1].split("\n## ", 1)[0]


def test_the_python_example_streams_an_answer(address: str, tmp_path: Path) -> None:
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", _http_section(), re.S)]
    script = tmp_path / "example.py"
    script.write_text(block.replace(PRINTED_ADDRESS, address))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip()) > 0


def test_each_curl_example_answers(address: str) -> None:
    if shutil.which("curl") is None:
        pytest.skip("needs curl")
    (block,) = [b for b in re.findall(r"```sh\n(.*?)```", _http_section(), re.S) if "curl" in b]
    joined = block.replace("\\\n", " ").replace(PRINTED_ADDRESS, address)
    tokens = shlex.split(joined)  # whole block: a quoted JSON body spans lines
    starts = [i for i, t in enumerate(tokens) if t == "curl"] + [len(tokens)]
    commands = [tokens[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]
    assert len(commands) >= 2
    for argv in commands:
        done = subprocess.run(argv + ["-w", "\n%{http_code}"], capture_output=True, text=True)
        body, status = done.stdout.rsplit("\n", 1)
        assert status == "200", body
        if not any('"stream": true' in t for t in argv):
            assert json.loads(body)["model"] == "demo"
            check_structured_answer(argv, json.loads(body))
        else:
            assert "event:" in body or "data:" in body


def check_structured_answer(argv: list[str], answer: dict) -> None:
    """An example that asks for JSON by schema gets what the README promises: JSON that
    validates, complete (`finish_reason` stop). The printed schema once let the demo add
    keys until `max_tokens` cut it: `finish_reason: length` and no JSON at all."""
    import jsonschema

    request = json.loads(argv[argv.index("-d") + 1])
    fmt = request.get("response_format", {})
    if fmt.get("type") != "json_schema":
        return
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), fmt["json_schema"]["schema"])
