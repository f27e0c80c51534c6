"""TextCodec and StreamingDetokenizer against transformers on small tokenizers built here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from colibrid.engine.tokenizer import StreamingDetokenizer, TextCodec, load_stop_token_ids
from colibrid.errors import CheckpointError, RequestError

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café, naïve, résumé, façade, Ångström, São Paulo, Zürich, coöperate.",
    "日本語のテキストです。中文文本测试。한국어 텍스트입니다.",
    "Emoji: 🙂🚀🎉 👩‍💻 🇫🇷 and ✨ sparkles ✨, 🐍 python 🐍.",
    "Русский текст, ελληνικά, עברית, العربية, हिन्दी.",
    "def f(x):\n    return x * 2  # code\n\ttabs and    spaces",
] * 20

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
]

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GLM = (
    "[gMASK]<sop>\n"
    "{%- if tools -%}<|system|>\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}{%- endif -%}\n"
    "{%- for m in messages -%}\n"
    "{%- if m.role == 'system' -%}<|system|>{{ m.content }}\n"
    "{%- elif m.role == 'user' -%}<|user|>{{ m.content }}\n"
    "{%- elif m.role == 'assistant' -%}<|assistant|>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% else %}<think></think>{% endif %}{{ m.content }}\n"
    "{%- else -%}{{ raise_exception('unknown role ' + m.role) }}\n"
    "{%- endif -%}\n{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
    "{% else %}<think>{% endif %}{%- endif -%}"
)


def build_bpe(glm_post_processor: bool = False) -> Tokenizer:
    """Byte-level BPE trained on the multilingual corpus; optional [gMASK]<sop> prefix."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens(["<think>", "</think>"])  # non-special added tokens are text
    if glm_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="[gMASK] <sop> $A",
            pair="[gMASK] <sop> $A $B",
            special_tokens=[
                ("[gMASK]", tok.token_to_id("[gMASK]")),
                ("<sop>", tok.token_to_id("<sop>")),
            ],
        )
    return tok


def write_model(path: Path, *, template: object, glm: bool = False, **files: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    build_bpe(glm).save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>" if glm else "<|im_end|>",
    }
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in files.items():
        (path / name.replace("__", ".")).write_text(
            content if isinstance(content, str) else json.dumps(content)
        )
    return path


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("chatml"), template=CHATML)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(
        tmp_path_factory.mktemp("glm"),
        glm=True,
        template=[{"name": "default", "template": GLM}, {"name": "other", "template": "x"}],
        generation_config__json={"eos_token_id": [0, 6, 8]},
        config__json={"eos_token_id": 0},
    )


@pytest.fixture(scope="module")
def codec(chatml_dir: Path) -> TextCodec:
    return TextCodec.load(chatml_dir)


def hf(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path))


MESSAGES = [
    [{"role": "user", "content": "Bonjour 🙂, ça va? 日本語"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi <|im_end|> x"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
        {"role": "user", "content": "👩‍💻 code?", "name": None},
    ],
]


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("which", ["chatml", "glm"])
def test_chat_matches_transformers(which, messages, chatml_dir, glm_dir):
    path = chatml_dir if which == "chatml" else glm_dir
    ours, ref = TextCodec.load(path), hf(path)
    for gen in (True, False):
        text = ref.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        assert ours.render_chat(messages, add_generation_prompt=gen) == text
        ids = ref.apply_chat_template(messages, add_generation_prompt=gen, return_dict=False)
        assert ours.encode_chat(messages, add_generation_prompt=gen) == list(ids)


def test_glm_kwargs_and_tools_match_transformers(glm_dir):
    ours, ref = TextCodec.load(glm_dir), hf(glm_dir)
    tools = [{"name": "météo", "parameters": {"ville": "Zürich 🙂"}}]
    msgs = MESSAGES[0]
    for kw in ({"enable_thinking": False}, {"enable_thinking": True}, {}):
        expect = ref.apply_chat_template(
            msgs, tools=tools, add_generation_prompt=True, tokenize=False, **kw
        )
        got = ours.render_chat(msgs, tools=tools, **kw)
        assert got == expect
    assert '"météo"' in got and got.startswith("[gMASK]<sop><|system|>")
    assert ours.render_chat(msgs, enable_thinking=False).endswith("<|assistant|><think></think>")


@pytest.mark.parametrize("text", ["Hello world", "  café 🚀 日本語\n", "<|im_end|>x<think>", ""])
@pytest.mark.parametrize("which", ["chatml", "glm"])
def test_encode_decode_match_transformers(which, text, chatml_dir, glm_dir):
    path = chatml_dir if which == "chatml" else glm_dir
    ours, ref = TextCodec.load(path), hf(path)
    for add in (True, False):
        assert ours.encode(text, add_special_tokens=add) == ref.encode(text, add_special_tokens=add)
    ids = ours.encode(text, add_special_tokens=True)
    assert ours.decode(ids) == ref.decode(ids)


def test_raw_glm_prefix_comes_from_post_processor(glm_dir, chatml_dir):
    glm = TextCodec.load(glm_dir)
    ids = glm.encode("hi", add_special_tokens=True)
    assert ids[:2] == [glm.token_to_id("[gMASK]"), glm.token_to_id("<sop>")]
    plain = TextCodec.load(chatml_dir)
    assert plain.encode("hi", add_special_tokens=True) == plain.encode(
        "hi", add_special_tokens=False
    )


def test_stop_token_ids_precedence(tmp_path, glm_dir, chatml_dir):
    assert TextCodec.load(glm_dir).stop_token_ids == frozenset({0, 6, 8})
    codec = TextCodec.load(chatml_dir)
    assert codec.stop_token_ids == frozenset({codec.token_to_id("<|im_end|>")})
    (tmp_path / "config.json").write_text('{"eos_token_id": 7}')
    assert load_stop_token_ids(tmp_path) == frozenset({7})
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [1, 2]}')
    assert load_stop_token_ids(tmp_path) == frozenset({1, 2})
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(CheckpointError, match="eos_token_id"):
        load_stop_token_ids(tmp_path)
    assert load_stop_token_ids(tmp_path / "nothing") == frozenset()


def test_chat_template_jinja_file_wins(tmp_path):
    path = write_model(
        tmp_path / "m", template=CHATML, chat_template__jinja="J{{ messages|length }}"
    )
    assert TextCodec.load(path).render_chat([{"role": "user", "content": "x"}]) == "J1"


def test_helpers_and_tojson(tmp_path):
    template = (
        "{{ strftime_now('%Y') | length }}|{{ tools | tojson }}|"
        "{{ {'a': 'é<'} | tojson(indent=2) }}|{{ bos_token is defined }}"
    )
    codec = TextCodec.load(write_model(tmp_path / "m", template=template))
    out = codec.render_chat([{"role": "user", "content": "x"}], tools=[{"n": "名前"}])
    assert out == '4|[{"n": "名前"}]|{\n  "a": "é<"\n}|False'


def test_errors_are_one_line(tmp_path, codec):
    with pytest.raises(CheckpointError, match="has no tokenizer.json; use --ids with --ids-out"):
        TextCodec.load(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        TextCodec.load(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be loaded") as info:
        TextCodec.load(bad)
    assert "\n" not in str(info.value)
    with pytest.raises(RequestError, match="unknown role tool"):
        TextCodec(codec._tok, chat_template=GLM).render_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(CheckpointError, match="does not parse"):
        TextCodec(codec._tok, chat_template="{% for %}").render_chat([{"role": "user"}])
    with pytest.raises(RequestError, match="no chat template; use --raw"):
        TextCodec(codec._tok).render_chat([{"role": "user", "content": "x"}])
    with pytest.raises(RequestError, match="non-empty list"):
        codec.render_chat([])
    no_default = TextCodec(codec._tok, chat_template={"a": "x"})
    with pytest.raises(CheckpointError, match="'default'"):
        no_default.render_chat([{"role": "user", "content": "x"}])


def test_lone_surrogate_is_a_request_error(codec):
    with pytest.raises(RequestError, match="not valid Unicode"):
        codec.encode("a\udcff", add_special_tokens=False)


def test_sandbox_blocks_escapes(codec):
    evil = TextCodec(codec._tok, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(RequestError):
        evil.render_chat([{"role": "user", "content": "x"}])


# ---- streaming detokenizer --------------------------------------------------------------
def stream(codec: TextCodec, ids: list[int], **kw) -> list[str]:
    detok = StreamingDetokenizer(codec, **kw)
    pieces = [detok.push(i) for i in ids]
    return pieces + [detok.flush()]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stream_equals_decode_on_random_ids(codec, data):
    ids = data.draw(st.lists(st.integers(0, codec.vocab_size - 1), max_size=60))
    assert "".join(stream(codec, ids)) == codec.decode(ids)


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(
        st.sampled_from(list("aé日本🙂🚀👩‍💻 ✨\nßЖ")) | st.characters(exclude_categories=("Cs",)),
        max_size=40,
    )
)
def test_stream_never_splits_characters(codec, text):
    ids = codec.encode(text, add_special_tokens=False)
    pieces = stream(codec, ids)
    assert "".join(pieces) == text == codec.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)


def test_stream_releases_emoji_only_when_complete(codec):
    emoji = "🙂".encode()
    byte_ids = [codec.token_to_id(tok) for tok in _byte_level_tokens(emoji)]
    assert stream(codec, byte_ids) == ["", "", "", "🙂", ""]
    # the text before an incomplete character is released right away
    ids = codec.encode("ab", add_special_tokens=False) + byte_ids[:2]
    assert "".join(stream(codec, ids)[:-1]) == "ab"


def test_stream_metaspace_keeps_spaces():
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁": 3, "!": 4, "x": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    codec = TextCodec(tok)
    ids = [1, 2, 3, 3, 5, 4, 2]
    assert "".join(stream(codec, ids)) == codec.decode(ids) == "hello world  x! world"


def _byte_level_tokens(data: bytes) -> list[str]:
    """GPT-2's byte -> printable character map, as ByteLevel uses it."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    table = dict(zip(bs, map(chr, cs), strict=True))
    return [table[b] for b in data]
