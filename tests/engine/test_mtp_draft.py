"""Drafting with the checkpoint's MTP layer (engine.mtp_draft): a layer built to predict
exactly what the main model predicts is right nearly every time; a random one almost never;
neither changes a token. Its experts stream through the store like any layer's."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from colibrid.engine.engine import Engine
from colibrid.engine.generate import TokenEvent, generate
from colibrid.engine.request_run import RequestRun
from colibrid.engine.sampling import SamplingParams
from colibrid.engine.speculate import OFF, SpecSettings
from colibrid.store.options import StoreOptions

MTP_ARCHS = ("deepseek_v3", "glm_moe_dsa", "deepseek_v32")


def mirror_mtp(folder) -> None:  # noqa: ANN001
    """Make the MTP layer (index 1 of a one-layer model) predict the main model's next token:
    the main layer's attention output is zeroed (so position cannot matter), embedding rows
    get unit RMS (so the MTP's input norm keeps them), eh_proj passes the embedding through,
    and the MTP decoder, its head norm and head are the main model's own."""
    files = {f: load_file(f) for f in sorted(folder.glob("*.safetensors"))}
    every = {k: v for tensors in files.values() for k, v in tensors.items()}
    emb = every["model.embed_tokens.weight"]
    emb = (emb / np.sqrt(np.mean(emb * emb, axis=1, keepdims=True))).astype(np.float32)
    d = emb.shape[1]
    new = {
        "model.embed_tokens.weight": emb,
        "model.layers.0.self_attn.o_proj.weight": np.zeros_like(
            every["model.layers.0.self_attn.o_proj.weight"]
        ),
    }
    for name, value in every.items():
        if name.startswith("model.layers.0."):
            new[name.replace("model.layers.0.", "model.layers.1.", 1)] = new.get(name, value)
    new["model.layers.1.eh_proj.weight"] = np.concatenate(
        [np.eye(d, dtype=np.float32), np.zeros((d, d), dtype=np.float32)], axis=1
    )
    new["model.layers.1.enorm.weight"] = np.ones(d, dtype=np.float32)
    new["model.layers.1.hnorm.weight"] = np.ones(d, dtype=np.float32)
    new["model.layers.1.shared_head.norm.weight"] = every["model.norm.weight"]
    new["model.layers.1.embed_tokens.weight"] = emb
    new["model.layers.1.shared_head.head.weight"] = every["lm_head.weight"]
    for path, tensors in files.items():
        save_file({k: new.get(k, v) for k, v in tensors.items()}, str(path))


@pytest.fixture(scope="module", params=MTP_ARCHS)
def mirrored(request, oracle_checkpoint):
    ref = oracle_checkpoint(
        request.param,
        config_overrides={"num_hidden_layers": 1, "first_k_dense_replace": 0},
    )
    mirror_mtp(ref.out_dir)
    return ref.out_dir


def answer(engine, prompt, params, spec):  # noqa: ANN001, ANN201
    events = list(generate(engine, prompt, params, speculate=spec))
    return [e.token_id for e in events if isinstance(e, TokenEvent)], events[-1]


def test_a_mirrored_mtp_layer_is_almost_always_right(mirrored) -> None:
    engine = Engine.load(mirrored, store=StoreOptions(mode="resident"), mtp=True)
    try:
        assert engine.mtp_on
        prompt = [int(t) for t in np.random.default_rng(2).integers(1, engine.vocab_size, 20)]
        for params in (
            SamplingParams(max_tokens=48),
            SamplingParams(max_tokens=48, temperature=0.7, seed=5),
        ):
            plain, _ = answer(engine, prompt, params, OFF)
            fast, done = answer(engine, prompt, params, SpecSettings("mtp", 4))
            assert fast == plain
            st = done.spec
            assert st.verifies > 0
            if params.greedy:  # sampled, the drafts' acceptance (and so whether MTP keeps
                # its place) depends on the depths the measured pass times chose
                assert st.mode == "mtp", st.describe()
                assert st.accepted >= 0.9 * st.drafted, st.describe()
    finally:
        engine.close()


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_a_random_mtp_layer_changes_nothing_streamed_or_not(oracle_checkpoint, arch) -> None:
    ref = oracle_checkpoint(arch)
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 384, 24)]
    params = SamplingParams(max_tokens=24)
    plain_engine = Engine.load(ref.out_dir, store=StoreOptions(mode="resident"))
    try:
        plain, _ = answer(plain_engine, prompt, params, OFF)
    finally:
        plain_engine.close()
    streamed = Engine.load(ref.out_dir, store=StoreOptions(mode="tiered", cache=1), mtp=True)
    try:
        store = streamed.experts
        mtp_layer = streamed.model.mtp.decoder.mlp.layer
        assert mtp_layer in store.served_layers, "MTP experts are in the store's layout"
        assert mtp_layer not in store.layers, "...but not in the usage profile's"
        fast, done = answer(streamed, prompt, params, SpecSettings("mtp", 3))
        assert fast == plain
        assert done.spec.drafted > 0
        assert store.placement.cache[mtp_layer], "the MTP layer's experts were read and cached"
        assert store.counts.shape[0] == max(store.layers) + 1
    finally:
        streamed.close()


def test_without_mtp_loaded_mtp_mode_drafts_by_prompt_lookup(oracle_checkpoint) -> None:
    engine = Engine.load(
        oracle_checkpoint("deepseek_v3").out_dir, store=StoreOptions(mode="resident")
    )
    try:
        assert not engine.mtp_on
        _, done = answer(
            engine, [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=4), SpecSettings("mtp")
        )
        assert done.spec.mode == "ngram"
    finally:
        engine.close()


def test_a_fork_drafts_over_the_shared_prompt_at_once(mirrored) -> None:
    """What the daemon does for OpenAI's `n` (serve.host): the other choices fork the first
    one's session once its first verify ran. The fork holds the MTP side's rows and the
    prompt's last hidden state, so its first step drafts (a fork whose MTP side started
    over could not draft until it had run a pass itself), and changes no token."""
    engine = Engine.load(mirrored, store=StoreOptions(mode="resident"), mtp=True)
    try:
        prompt = [int(t) for t in np.random.default_rng(4).integers(1, engine.vocab_size, 20)]
        params, spec = SamplingParams(max_tokens=12), SpecSettings("mtp", 4)
        session = engine.new_session()
        first = RequestRun(engine, prompt, params, session=session, speculate=spec)
        list(first.begin())
        list(first.take(engine.run([first.next_pass()])[0]))  # the prompt; its first token
        engine.run([first.next_pass()])  # its first verify: the host forks after this step
        fork = session.fork(len(prompt))
        assert fork.mtp.hidden_start == len(prompt) - 1 and fork.mtp.covered <= len(prompt) - 1
        other = RequestRun(engine, prompt, params, session=fork, speculate=spec)
        begun = list(other.begin())  # answered from the remembered logits: nothing prefilled
        assert other.reuse == len(prompt)
        assert len(other.next_pass().tokens) > 1  # a verify: drafts at its first step
        assert drive(engine, other, begun) == answer(engine, prompt, params, OFF)[0]
    finally:
        engine.close()


def drive(engine: Engine, run: RequestRun, events: list) -> list[int]:
    """Run `run` to its end, one pass at a time; every token it generated."""
    while not run.finished:
        events += run.take(engine.run([run.next_pass()])[0])
    return [e.token_id for e in events if isinstance(e, TokenEvent)]
