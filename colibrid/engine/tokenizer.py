"""Text in and out of token ids: the checkpoint's tokenizer, its chat template, stop ids.

`TextCodec` wraps `tokenizer.json` (the `tokenizers` library, so the ids are exactly the
ones Hugging Face produces) and renders the chat template the way transformers'
`apply_chat_template` does, so a prompt built here is byte-identical to the reference,
under the limits of `chat_template` (a template is a program from whoever published the
model; `load` renders a sample chat so that a template bomb refuses the model at once).
`StreamingDetokenizer` turns a stream of generated ids into text pieces that never split
a UTF-8 character, which byte-level BPE tokens routinely do.

Every problem a user can cause (a missing or corrupt file, a template that fails) is a
one-line `CheckpointError` or `RequestError`, never a traceback.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from colibrid.engine.chat_template import (
    DEFAULT_MAX_CONTEXT,
    DEFAULT_TIME_S,
    ChatTemplate,
    Limits,
    probe,
)
from colibrid.engine.model_files import (
    MAX_JSON_BYTES,
    MAX_TEMPLATE_BYTES,
    MAX_TOKENIZER_BYTES,
    present,
    read_model_text,
)
from colibrid.errors import (
    CheckpointError,
    ColibriError,
    RequestError,
    contain_panics,
    first_line,
)

# The special-token names transformers passes to every chat template (special_tokens_map).
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names a message's reasoning may come under; templates read `reasoning_content`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def read_json(path: Path) -> Any | None:
    """Parse a JSON file of the checkpoint; None if absent, CheckpointError if unreadable
    (or a link out of the folder, not a regular file, too large: see `model_files`)."""
    text = read_model_text(path.parent, path.name, MAX_JSON_BYTES)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {first_line(exc)}") from None


def has_tokenizer(model_dir: str | Path) -> bool:
    """Whether the checkpoint comes with a tokenizer.json entry: one that is there but
    unreadable (a device, a link outside the folder) is then refused by `TextCodec.load`
    with the reason, rather than the model being served as if it had none."""
    return present(Path(model_dir), "tokenizer.json")


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _eos_ids(value: Any, source: Path) -> frozenset[int] | None:
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise CheckpointError(f"{source}: eos_token_id must be a token id or a list of them")
    return frozenset(items)


def load_stop_token_ids(
    model_dir: str | Path, token_to_id: Callable[[str], int | None] | None = None
) -> frozenset[int]:
    """Token ids that end generation, in the order of precedence transformers uses.

    `generation_config.json` `eos_token_id` (int or list), else `config.json`'s, else the
    tokenizer's eos token (needs `token_to_id`). Usable without a tokenizer, so `--ids`
    mode on a checkpoint without tokenizer files still stops at end-of-sequence.
    """
    root = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        path = root / name
        data = read_json(path)
        if isinstance(data, Mapping):
            ids = _eos_ids(data.get("eos_token_id"), path)
            if ids is not None:
                return ids
    if token_to_id is not None:
        config = read_json(root / "tokenizer_config.json")
        if isinstance(config, Mapping):
            eos = _token_content(config.get("eos_token"))
            tid = token_to_id(eos) if eos is not None else None
            if tid is not None:
                return frozenset([tid])
    return frozenset()


def _pick_template(raw: Any, source: Path) -> str | dict[str, str] | None:
    """tokenizer_config.json `chat_template`: a string or a list of {name, template}."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list) and all(
        isinstance(t, Mapping)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in raw
    ):
        return {t["name"]: t["template"] for t in raw}
    raise CheckpointError(f"{source}: chat_template must be a string or a list of name/template")


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Drop None-valued keys and alias reasoning fields, as transformers does."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError("a chat needs a non-empty list of messages")
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise RequestError(f"a chat message must be an object, got {type(message).__name__}")
        msg = {k: v for k, v in message.items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


class TextCodec:
    """A checkpoint's tokenizer, chat template and stop ids. Load with `TextCodec.load`.

    `max_context` (settable) sizes the template's output limit: a prompt never needs
    more than a few characters per token of context, plus the input itself.
    `template_time_s` bounds one render.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | dict[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
        origin: str = "<memory>",
        max_context: int | None = None,
    ) -> None:
        self._tok = tokenizer
        self._templates = chat_template
        self._compiled: dict[str, ChatTemplate] = {}
        self._bytes_of: Any = None  # llguidance's view of the tokenizer (token_bytes)
        self._bytes_lock = threading.Lock()
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.stop_token_ids = frozenset(stop_token_ids)
        self.origin = origin
        self.max_context = max_context or DEFAULT_MAX_CONTEXT
        self.template_time_s = DEFAULT_TIME_S

    @classmethod
    def load(cls, model_dir: str | Path, *, max_context: int | None = None) -> TextCodec:
        """The codec of a checkpoint folder. Its chat template is tried on a sample chat:
        a template that goes over a limit on it is a CheckpointError (the model is refused)."""
        from tokenizers import Tokenizer

        root = Path(model_dir)
        if not root.is_dir():
            raise CheckpointError(f"model dir {root} does not exist or is not a directory")
        path = root / "tokenizer.json"
        text = read_model_text(root, "tokenizer.json", MAX_TOKENIZER_BYTES)
        if text is None:
            raise CheckpointError(
                f"model dir {root} has no tokenizer.json; use --ids with --ids-out"
            )
        try:
            with contain_panics(f"reading {path}"):
                tokenizer = Tokenizer.from_str(text)
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise CheckpointError(f"{path} cannot be loaded: {first_line(exc)}") from None

        config = read_json(root / "tokenizer_config.json") or {}
        legacy = read_json(root / "special_tokens_map.json") or {}
        if not isinstance(config, Mapping) or not isinstance(legacy, Mapping):
            raise CheckpointError(f"{root}: tokenizer_config.json must hold a JSON object")
        special = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = _token_content(config.get(key, legacy.get(key)))
            if value is not None:
                special[key] = value

        # transformers: chat_template.jinja wins over the field in tokenizer_config.json.
        template: str | dict[str, str] | None = read_model_text(
            root, "chat_template.jinja", MAX_TEMPLATE_BYTES
        )
        if template is None:
            template = _pick_template(config.get("chat_template"), root / "tokenizer_config.json")

        stops = load_stop_token_ids(root, tokenizer.token_to_id)
        codec = cls(
            tokenizer,
            chat_template=template,
            special_tokens=special,
            stop_token_ids=stops,
            origin=str(root),
            max_context=max_context,
        )
        codec.probe_chat_template()
        return codec

    def probe_chat_template(self) -> None:
        """Refuse a template that is a bomb on every request (see `chat_template.probe`)."""
        templates = self._templates
        if not templates:
            return
        sources = templates.values() if isinstance(templates, dict) else [templates]
        probe(self.render_chat, self.origin, mentions_tools=any("tools" in t for t in sources))

    # ---- ids <-> text -------------------------------------------------------------------
    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`; `add_special_tokens` runs the tokenizer's post-processor.

        Through `encode_batch`, which releases the GIL while it works (`encode` holds it):
        a multi-megabyte prompt tokenised on the engine thread must not stall the event
        loop that answers `/health`, `ps` and other clients meanwhile. Same ids."""
        try:
            with contain_panics("the model's tokenizer"):  # e.g. a pre-tokenizer regex
                batch = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
            return list(batch[0].ids)
        except TypeError:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # lone surrogates, e.g. from non-UTF-8 argv
                raise RequestError(f"text is not valid Unicode: {exc.reason}") from None
            raise

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; keeps special tokens by default, as transformers' `decode` does."""
        with contain_panics("the model's tokenizer"):
            return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (part of a UTF-8 character, possibly: what
        `decode` of the token alone would show as U+FFFD). llguidance knows them for every
        tokenizer kind (byte-level BPE, SentencePiece byte fallback); its view is built on
        the first call (a fraction of a second), which `serve.prepare` makes off the engine
        thread for a request asking for logprobs."""
        with self._bytes_lock:
            if self._bytes_of is None:
                from colibrid.engine.grammar import llg_tokenizer

                self._bytes_of = llg_tokenizer(
                    self.tokenizer_json(), self.vocab_size, self.stop_token_ids
                )
        if not 0 <= token_id < self._bytes_of.vocab_size:
            return b""
        return bytes(self._bytes_of.decode_bytes([token_id]))

    def special_token_names(self) -> frozenset[str]:
        """The tokenizer's special tokens (what a grammar may name as tokens)."""
        added = self._tok.get_added_tokens_decoder().values()
        return frozenset(t.content for t in added if t.special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Size including added tokens (ids run 0..vocab_size-1)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def tokenizer_json(self) -> str:
        """The tokenizer serialized as `tokenizer.json` (what a grammar engine reads to
        learn every token's bytes: engine.constraint.Vocabulary)."""
        return self._tok.to_str()

    # ---- chat ---------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    @property
    def chat_templates(self) -> str | dict[str, str] | None:
        """The template source(s) as the checkpoint gives them (what the HTTP layer reads to
        see whether the model takes tools or thinks)."""
        return self._templates

    def generation_prompt(self) -> str | None:
        """The rendered prompt of a one-message chat (None without a template or when the
        template fails on it): what the model's answer continues. Thinking templates
        (Qwen3 "Thinking-2507", DeepSeek-V3.1 in thinking mode) end it in `<think>`, so
        the answer starts inside the reasoning and only closes it."""
        if not self._templates:
            return None
        try:
            return self.render_chat([{"role": "user", "content": "Hi"}])
        except ColibriError:
            return None

    def _template(self, tools: Any) -> ChatTemplate:
        templates = self._templates
        if not templates:
            raise RequestError(f"model dir {self.origin} has no chat template; use --raw")
        if isinstance(templates, dict):
            name = "tool_use" if tools is not None and "tool_use" in templates else "default"
            if name not in templates:
                raise CheckpointError(
                    f"{self.origin}: several chat templates and none named 'default'"
                )
        else:
            name = "default"
        if name not in self._compiled:
            source = templates[name] if isinstance(templates, dict) else templates
            self._compiled[name] = ChatTemplate(source, self.origin)
        return self._compiled[name]

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text the chat template makes of `messages` (transformers-compatible).

        Extra keyword arguments (e.g. `enable_thinking=False`) reach the template as
        variables and override the special tokens of the same name. Any failure of the
        template, or a limit it goes over, is one `TemplateError` line.
        """
        template = self._template(tools)
        normalized = _normalize_messages(messages)
        limits = Limits.for_chat(self.max_context, normalized, tools, time_s=self.template_time_s)
        variables = {
            **self.special_tokens,
            **kwargs,
            "messages": normalized,
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        return template.render(limits, variables)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        """Ids of the rendered chat. Like `apply_chat_template(tokenize=True)` the text is
        encoded without the post-processor's specials: the template writes its own."""
        return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=False)


class StreamingDetokenizer:
    """Incremental decoding: `push` ids one at a time, get text pieces that join up to
    exactly `codec.decode(all ids)` and never end in half a UTF-8 character.

    Byte-level BPE tokens can split a multi-byte character, and some decoders (Metaspace)
    drop the leading space of a sequence, so a token cannot be decoded on its own.
    Instead the text of `context + pending` is diffed against the text of `context`, where
    `context` is the last chunk of ids whose text was released in full (a bounded window,
    so each push costs O(1) in the length of the output). While the pending text ends
    in U+FFFD (an incomplete character, as the lossy decoder renders it) the tail is held
    back; the text before it is released as soon as it is known. A run of more than
    `max_pending` ids that never completes (the model emitting invalid bytes) is released
    as it is, keeping the cost bounded.
    """

    def __init__(self, codec: TextCodec, *, max_pending: int = 64) -> None:
        self._codec = codec
        self._max_pending = max_pending
        self._context: list[int] = []
        self._context_len = 0  # len(decode(context))
        self._pending: list[int] = []
        self._released = 0  # chars of the pending text already returned

    def push(self, token_id: int) -> str:
        self._pending.append(int(token_id))
        text = self._codec.decode(self._context + self._pending)[self._context_len :]
        if text.endswith("\ufffd") and len(self._pending) < self._max_pending:
            safe = len(text.rstrip("\ufffd"))
            piece = text[self._released : safe] if safe > self._released else ""
            self._released += len(piece)
            return piece
        return self._commit(text)

    def flush(self) -> str:
        """Release whatever is held back (possibly ending in U+FFFD) and start afresh."""
        if not self._pending:
            return ""
        text = self._codec.decode(self._context + self._pending)[self._context_len :]
        piece = self._commit(text)
        self._context, self._context_len = [], 0
        return piece

    def _commit(self, text: str) -> str:
        piece = text[self._released :]
        self._context = self._pending
        self._context_len = len(self._codec.decode(self._context))
        self._pending = []
        self._released = 0
        return piece
