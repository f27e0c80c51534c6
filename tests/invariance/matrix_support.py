"""Support of the daemon invariance matrix (test_daemon_matrix.py): the clients (SERVE,
HTTP, `colibrid generate`), the models it serves (the demo, tiny streamed GLM-5 / DeepSeek
int4 containers) and, per model, the resident store's reference answers and the usage
profiles a resident daemon leaves behind (fixtures, made visible by conftest.py)."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import tiny_models
from daemon_helpers import Home, free_port, install_chat_tokenizer
from structured_cases import SCHEMAS

from colibrid.store.usage import parse_counts

PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
)
MAX_TOKENS = 14
# A constrained answer rides along with the free ones (HTTP `response_format` json_schema,
# SERVE `colibri ask --json-schema`): the grammar's mask must not change with placement
# either. Keys of the answer dicts: the prompt, or "json: " + the prompt.
SCHEMA, _, (SCHEMA_PROMPT, *_) = SCHEMAS["object"]
# The tiny models' tokenizer is byte-level and a random model writes any code point, so the
# 16-character name can take 64 tokens: room for the longest complete answer (~90 tokens);
# a constrained answer ends where its grammar does, so the room costs nothing otherwise.
SCHEMA_TOKENS = 128
JSON_KEY = "json: " + SCHEMA_PROMPT
QUERIES = (*PROMPTS, JSON_KEY)
SETTINGS = dict(prompt_cache=False, profile_save_s=0.5, shutdown_grace_s=2.0)
BATCH_ROUNDS = 4  # concurrent rounds tried until the daemon batches two of the asks


@dataclass(frozen=True)
class Model:
    kind: str  # "demo" or an oracle arch
    path: Path

    @property
    def name(self) -> str:  # what the daemon serves it as (its folder name)
        return self.path.name


@dataclass
class Reference:
    """The resident store's answers (by client, then prompt) and its saved profiles."""

    model: Model
    serve: dict[str, str]
    http: dict[str, str]
    profiles: Path  # profiles/<model>/ of the resident daemon: default + code .coli_usage
    ids: list[int] = field(default_factory=list)  # a prompt for `colibrid generate --ids`
    generated: str = ""  # `colibrid generate --ids-out` on the resident store


def ask(home: Home, query: str) -> str:
    """`colibri ask` greedy (with `--json-schema` for JSON_KEY); its stdout, or a line
    naming the failure."""
    args = ["--max-tokens", str(MAX_TOKENS), "--temperature", "0", query]
    if query == JSON_KEY:
        schema = home.path / "schema.json"
        schema.write_text(json.dumps(SCHEMA))
        args = ["--json-schema", str(schema), "--max-tokens", str(SCHEMA_TOKENS)]
        args += ["--temperature", "0", SCHEMA_PROMPT]
    r = home.colibri("ask", *args)
    if r.returncode != 0:
        return f"<colibri ask failed rc={r.returncode}: {r.stderr.strip()[-400:]}>"
    return r.stdout


def ask_http(port: int, model: str, query: str) -> str:
    """The official `openai` client, greedy chat completion (a `json_schema`
    response_format for JSON_KEY); its text, or the failure."""
    import openai

    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
    )
    shape: dict = dict(messages=[{"role": "user", "content": query}], max_tokens=MAX_TOKENS)
    if query == JSON_KEY:
        shape = dict(
            messages=[{"role": "user", "content": SCHEMA_PROMPT}],
            max_tokens=SCHEMA_TOKENS,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
            },
        )
    try:
        reply = client.chat.completions.create(model=model, temperature=0, **shape)
    except openai.OpenAIError as exc:
        return f"<HTTP request failed: {type(exc).__name__}: {str(exc)[-400:]}>"
    return reply.choices[0].message.content or ""


def ask_all(home: Home, port: int, model: str) -> tuple[dict[str, str], dict[str, str]]:
    """Every prompt through SERVE and HTTP at once (all in flight together)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2 * len(QUERIES)) as pool:
        serve = {q: pool.submit(ask, home, q) for q in QUERIES}
        http = {q: pool.submit(ask_http, port, model, q) for q in QUERIES}
        return {p: f.result() for p, f in serve.items()}, {p: f.result() for p, f in http.items()}


def generate_ids(model: Path, ids: list[int], *flags: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "colibrid", "generate", "--model", str(model)]
        + ["--ids", ",".join(map(str, ids)), "--ids-out", "--max-tokens", "20", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        return f"<colibrid generate {' '.join(flags)} failed rc={r.returncode}: {r.stderr[-400:]}>"
    return r.stdout


def status(home: Home) -> dict:
    from colibri_cli.client import Client

    with Client.connect(home.socket, timeout_s=30) as client:
        return client.query("STATUS")


def prompt_ids(model: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model / "tokenizer.json")).encode(text).ids


@pytest.fixture(scope="session")
def streamed_model(oracle_checkpoint, tmp_path_factory):
    """Factory: ``streamed_model(arch) -> Model``: the tiny oracle checkpoint of ``arch`` as
    an int4 container (`colibri convert`, experts streamable by the tiered store), with a
    tokenizer and chat template so the text clients can talk to it. ``FP4_KIND`` is tiny
    gpt-oss stored with MXFP4 experts, converted with them kept at 4 bits (FP4)."""
    cache: dict[str, Model] = {}

    def get(arch: str) -> Model:
        if arch == MIXED_KIND and arch not in cache:
            src = oracle_checkpoint(MIXED_FROM).out_dir
            cache[arch] = mixed_model(get(MIXED_FROM), src, tmp_path_factory.mktemp("mixed"))
        if arch not in cache:
            if arch == FP4_KIND:  # gpt-oss as OpenAI ships it: the converter keeps MXFP4
                src = tiny_models.write_mxfp4_source(
                    oracle_checkpoint("gpt_oss").out_dir,
                    tmp_path_factory.mktemp("mxfp4") / "gpt-oss-mxfp4",
                )
            else:
                src = oracle_checkpoint(arch).out_dir
            dst = tmp_path_factory.mktemp("streamed") / f"tiny-{arch}"
            r = subprocess.run(
                [sys.executable, "-m", "colibri_cli", "convert", str(src), str(dst), "--quiet"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert r.returncode == 0, r.stdout + r.stderr
            install_chat_tokenizer(dst)
            cache[arch] = Model(arch, dst)
        return cache[arch]

    return get


FP4_KIND = "gpt_oss_fp4"
# tiny GLM-5 requantised by heat (colibri requant): hot experts int8, the middle int4-g64,
# cold ones int3-affine-g64 — a container with three expert formats (issue 41)
MIXED_KIND = "glm_moe_dsa_mixed"
MIXED_FROM = "glm_moe_dsa"


def synthetic_profile(model: Path, path: Path) -> Path:
    """A fixed, skewed `.coli_usage` for ``model`` (counts fall with the expert index,
    rotated per layer so every layer ranks its experts differently)."""
    from colibrid.store.usage import usage_text

    config = json.loads((model / "config.json").read_text())
    layers, experts = int(config["num_hidden_layers"]), int(config["n_routed_experts"])
    counts = np.zeros((layers, experts), dtype=np.int64)
    for layer in range(layers):
        for e in range(experts):
            counts[layer, (e + layer) % experts] = 10 * (experts - e)
    path.write_bytes(usage_text(counts, str(config["model_type"])))
    return path


def mixed_model(int4: Model, source: Path, folder: Path) -> Model:
    """``int4`` requantised by a synthetic profile into three expert formats."""
    dst = folder / f"tiny-{MIXED_KIND}"
    profile = synthetic_profile(int4.path, folder / "mixed.coli_usage")
    r = subprocess.run(
        [sys.executable, "-m", "colibri_cli", "requant", str(int4.path), "--by-heat", str(profile)]
        + ["--hot-share", "0.25", "--hot-bits", "8", "--cold-share", "0.5", "--cold-bits", "3"]
        + ["--source", str(source), "-o", str(dst), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    install_chat_tokenizer(dst)
    return Model(MIXED_KIND, dst)


def matrix_model(request: pytest.FixtureRequest, kind: str) -> Model:
    """The model of a test: "demo" or an oracle arch (fixtures looked up lazily, so a run
    that only needs the tiny models never builds the demo, and vice versa)."""
    if kind == "demo":
        return Model("demo", request.getfixturevalue("demo_container"))
    return request.getfixturevalue("streamed_model")(kind)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Factory: ``reference(model) -> Reference``, one resident daemon per model (cached).

    The resident store (no placement key in config.toml: the automatic choice keeps these
    small models' experts resident, checked in `ps`) answers every prompt through SERVE and
    HTTP one at a time, then all at once (must agree: concurrency alone changes nothing),
    and `colibri profile warm code` leaves a warmed `code` profile; the asks leave counts
    in `default`. Both files are what the tiered cells start from."""
    cache: dict[str, Reference] = {}

    def get(model: Model) -> Reference:
        kind = model.kind
        if kind in cache:
            return cache[kind]
        port = free_port()
        # The plain run: no speculation (the cells run the daemon's default, `auto`)
        home = Home(
            tmp_path_factory.mktemp(f"ref-{kind}"),
            model.path,
            http=str(port),
            speculate="off",
            **SETTINGS,
        )
        try:
            home.start()
            tiers = status(home)["tiers"]
            assert tiers["disk"]["experts"] == 0, f"reference is not resident: {tiers}"
            serve = {q: ask(home, q) for q in QUERIES}
            http = {q: ask_http(port, model.name, q) for q in QUERIES}
            for text in [*serve.values(), *http.values()]:
                assert text and not text.startswith("<"), (text, home.log())
            for text in (serve[JSON_KEY], http[JSON_KEY]):  # the schema held
                jsonschema.validate(json.loads(text), SCHEMA)
            # Concurrent rounds until two requests shared a pass (client processes that
            # start slowly on a busy machine can each finish alone); every round must agree
            for _ in range(BATCH_ROUNDS):
                again = ask_all(home, port, model.name)
                assert again == (serve, http), (
                    f"the resident store alone differs between serial and concurrent asks:\n"
                    f"serial {serve} {http}\nconcurrent {again}"
                )
                if status(home)["shared_passes"] > 0:
                    break
            assert status(home)["shared_passes"] > 0, "the concurrent asks were not batched"
            warm = home.colibri("profile", "warm", "code", "--limit", "3", "--max-tokens", "8")
            assert warm.returncode == 0, warm.stderr
        finally:
            home.close()
        profiles = home.path / "profiles" / model.name
        for name in ("default", "code"):
            text = (profiles / f"{name}.coli_usage").read_text()
            assert any(c.isdigit() and c != "0" for c in text), f"{name} profile has no counts"
        ids = prompt_ids(model.path, PROMPTS[0])
        generated = generate_ids(model.path, ids)
        assert generated and not generated.startswith("<"), generated
        cache[kind] = Reference(model, serve, http, profiles, ids, generated)
        return cache[kind]

    return get


def copy_profiles(ref: Reference, home: Path, *, hottest_quarter: bool = False) -> None:
    """Start a home with the reference's warmed profiles (default + code). With
    ``hottest_quarter`` each layer keeps only its hottest quarter of experts, so
    `pin = "all"` pins some experts and the rest still stream, even beside a cache of half
    a layer (a tiny model's warm touches every expert)."""
    dst = home / "profiles" / ref.model.name
    dst.mkdir(parents=True, exist_ok=True)
    for path in ref.profiles.glob("*.coli_usage"):
        if not hottest_quarter:
            shutil.copy(path, dst / path.name)
            continue
        text = path.read_text()
        head = text.splitlines()[:2]  # "-1 <layers> <experts>", "-2 <version> <hash>"
        shape = tuple(int(x) for x in head[0].split()[1:])
        counts = parse_counts(text, path, shape, trusted=True)
        keep = max(1, shape[1] // 4)
        for row in counts:  # zero all but the hottest quarter (ties to the lower expert)
            row[np.lexsort((np.arange(row.size), -row))[keep:]] = 0
        rows = [f"{la} {e} {counts[la, e]}" for la, e in zip(*np.nonzero(counts), strict=True)]
        (dst / path.name).write_text("\n".join(head + rows) + "\n")
