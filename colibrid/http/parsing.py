"""Splitting generated text into reasoning, answer and tool calls (pure, incremental).

GLM-style output: an optional ``<think>…</think>`` block first (the reasoning), then the
answer, then zero or more ``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>
</tool_call>`` blocks (a JSON ``{"name": …, "arguments": …}`` body is accepted too: Qwen3's
form), DeepSeek-V3/V3.1's calls between its ``<｜tool▁calls▁begin｜>`` tokens, or
DeepSeek-V3.2's DSML block (``<｜DSML｜function_calls>`` holding ``<｜DSML｜invoke name=…>``
elements, one ``<｜DSML｜parameter name=… string="true|false">`` per argument).
`OutputSplitter.feed` returns pieces as soon as they are certain, holding back only a
tail that could still turn out to be the start of a tag; `finish` flushes and parses the
tool calls. Which parts are looked for is decided from the chat template (`Features`);
a Harmony template (gpt-oss) gets `harmony.HarmonySplitter` instead (`splitter.make_splitter`
chooses: this module is below both and imports neither).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

THINK_OPEN, THINK_CLOSE, TOOL_OPEN = "<think>", "</think>", "<tool_call>"
# DeepSeek-V3 / V3.1: calls between special tokens, `function<sep>name` + a fenced JSON block
# (V3) or `name<sep>` + the JSON (V3.1)
DEEPSEEK_TOOLS_OPEN = "<｜tool▁calls▁begin｜>"
# DeepSeek-V3.2: DSML markup in plain text (fullwidth bars), every argument a parameter
# element whose `string` attribute says whether its body is raw text or a JSON value
DSML = "｜DSML｜"
DSML_OPEN = f"<{DSML}function_calls>"
DSML_CLOSE = f"</{DSML}function_calls>"
# Any of these starts the calls, whatever the family (none occurs in plain text): a
# grammar-forced call is written in the template's own syntax where http.structured
# knows it (DSML), else in the `<tool_call>{json}` form.
TOOL_OPENERS = (TOOL_OPEN, DEEPSEEK_TOOLS_OPEN, DSML_OPEN)
_DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)(?:<｜tool▁call▁end｜>|$)", re.S)
_DEEPSEEK_SEP = "<｜tool▁sep｜>"
_DSML_INVOKE = re.compile(rf'<{DSML}invoke\s+name="([^"<>]*)"\s*>(.*?)(?:</{DSML}invoke>|$)', re.S)
_DSML_PARAMETER = re.compile(
    rf'<{DSML}parameter\s+name="([^"<>]*)"\s+string="(true|false)"\s*>(.*?)'
    rf"</{DSML}parameter>",
    re.S,
)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*(?:```)?$", re.S)
HARMONY_CHANNEL = "<|channel|>"
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


@dataclass(frozen=True)
class Features:
    """What the checkpoint's chat template supports."""

    tools: bool = False
    think: bool = False
    think_open: bool = False  # the generation prompt opens `<think>`: output starts inside it
    harmony: bool = False  # gpt-oss's channels (<|channel|>analysis / final)
    # the syntax a forced call is written in (http.structured): "json" (`<tool_call>{…}`),
    # "dsml" (DeepSeek-V3.2), "harmony" (gpt-oss), "deepseek_v3" or "deepseek_v31"; the
    # last three only where the tokenizer has their markers as special tokens
    call_syntax: str = "json"
    # the template's own calls are `<tool_call>` + JSON (Hermes, Qwen): "json" is then its
    # own syntax, not only the form a forced call falls back to (http.tools on auto)
    json_calls: bool = False

    @classmethod
    def of_template(
        cls,
        template: Any,
        generation_prompt: str | None = None,
        specials: frozenset[str] = frozenset(),
    ) -> Features:
        """From the template's source and, where known, the prompt it renders for a chat
        (`TextCodec.generation_prompt`) and the tokenizer's special tokens."""
        text = json.dumps(template) if isinstance(template, dict) else str(template or "")
        opens = generation_prompt is not None and generation_prompt.rstrip().endswith(THINK_OPEN)
        harmony = HARMONY_CHANNEL in text
        return cls(
            tools="tools" in text,
            think=opens or THINK_OPEN in text or "thinking" in text,
            think_open=opens,
            harmony=harmony,
            call_syntax=_call_syntax(text, harmony, specials),
            json_calls=TOOL_OPEN in text and "<arg_key>" not in text,  # GLM's: arg_key tags
        )


# A remote model (colibrid.remote): its endpoint applies its own chat template and takes
# tools as tools; its reasoning and calls come back in `<think>` and `<tool_call>{json}`
# form (remote.chunks), which is what these features read.
REMOTE_FEATURES = Features(tools=True, think=True, call_syntax="json", json_calls=True)

HARMONY_CALL_TOKENS = frozenset({"<|channel|>", "<|constrain|>", "<|message|>"})
DEEPSEEK_CALL_TOKENS = frozenset(
    {DEEPSEEK_TOOLS_OPEN, "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"}
    | {"<｜tool▁calls▁end｜>"}
)


def _call_syntax(text: str, harmony: bool, specials: frozenset[str]) -> str:
    """The template's own call syntax where a grammar can write it (Features.call_syntax):
    DSML is plain text; Harmony's and DeepSeek-V3's markers are special tokens, which a
    grammar can only name if the tokenizer has them."""
    if DSML in text:
        return "dsml"
    if harmony and HARMONY_CALL_TOKENS <= specials:
        return "harmony"
    if DEEPSEEK_TOOLS_OPEN in text and DEEPSEEK_CALL_TOKENS <= specials:
        return "deepseek_v3" if "```json" in text else "deepseek_v31"  # V3 fences the JSON
    return "json"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def held_tag_prefix(buf: str, tag: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every well-formed call in `text` (an unterminated last block is accepted)."""
    if text.startswith(DEEPSEEK_TOOLS_OPEN):
        return parse_deepseek_calls(text)
    if text.startswith(DSML_OPEN):
        return parse_dsml_calls(text)
    calls = []
    for body in _CALL.findall(text):
        body = body.strip()
        if body.startswith("{"):
            try:
                obj = json.loads(body)
            except ValueError:
                continue
            args = (
                obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
            )
            if isinstance(args, str):
                args = _value(args)
            if (
                isinstance(obj, dict)
                and isinstance(obj.get("name"), str)
                and isinstance(args, dict)
            ):
                calls.append(ToolCall(obj["name"], args))
            continue
        name = body.split("<arg_key>", 1)[0].strip()
        if name and "<" not in name and "\n" not in name:
            args = {k.strip(): _value(v.strip()) for k, v in _ARG.findall(body)}
            calls.append(ToolCall(name, args))
    return calls


def parse_deepseek_calls(text: str) -> list[ToolCall]:
    """DeepSeek-V3's `function<sep>NAME\n```json\nARGS\n```` and V3.1's `NAME<sep>ARGS`
    calls; one whose arguments are not a JSON object is dropped."""
    calls = []
    for body in _DEEPSEEK_CALL.findall(text):
        head, sep, rest = body.partition(_DEEPSEEK_SEP)
        if not sep:
            continue
        name, args_text = head.strip(), rest.strip()
        if name == "function":  # V3: the name opens the rest, the arguments are fenced
            name, _, args_text = args_text.partition("\n")
            name, args_text = name.strip(), args_text.strip()
        fenced = _FENCE.match(args_text)
        args = _value(fenced.group(1) if fenced else args_text)
        if name and "<" not in name and isinstance(args, dict):
            calls.append(ToolCall(name, args))
    return calls


def parse_dsml_calls(text: str) -> list[ToolCall]:
    """DeepSeek-V3.2's DSML calls: each ``invoke`` element a call, each ``parameter`` in it
    an argument, its body taken as it is (``string="true"``) or as JSON (``"false"``; a
    body that is not JSON stays text). An invoke cut short keeps its whole parameters;
    one without a name is dropped."""
    calls = []
    for name, body in _DSML_INVOKE.findall(text):
        args = {
            key: (value if raw == "true" else _value(value.strip()))
            for key, raw, value in _DSML_PARAMETER.findall(body)
        }
        if name.strip():
            calls.append(ToolCall(name.strip(), args))
    return calls


class OutputSplitter:
    """Feed text pieces; get ``("reasoning" | "content", text)`` pieces back."""

    def __init__(self, features: Features) -> None:
        self.features = features
        if features.think_open:  # the prompt opened the reasoning; the model closes it
            self.mode = "reasoning"
        else:
            self.mode = "start" if features.think else "content"
        self.buf = ""
        self.tool_text = ""
        self.after_reasoning = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        return self._drain(final=False)

    def finish(self, *, whole: bool = True) -> tuple[list[tuple[str, str]], list[ToolCall]]:
        """The rest, and the tool calls; an answer that is not `whole` (a constrained one
        cut short) makes no calls: its call text is returned as content."""
        pieces = self._drain(final=True)
        if self.mode == "tools":
            calls = parse_tool_calls(self.tool_text) if whole else []
            if not calls:  # not a call after all: it was answer text
                pieces.append(("content", self.tool_text))
            return pieces, calls
        return pieces, []

    def _drain(self, *, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while self.buf:
            before = (self.mode, len(self.buf))
            if self.mode == "start":
                head = self.buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self.buf = head[len(THINK_OPEN) :]
                    self.mode = "reasoning"
                elif THINK_OPEN.startswith(head) and not final:
                    break
                else:
                    self.mode = "content"
            elif self.mode == "reasoning":
                self._until((THINK_CLOSE,), "reasoning", "content", out, final)
                if self.mode == "content":
                    self.after_reasoning = True
            elif self.mode == "content":
                if self.after_reasoning:
                    self.buf = self.buf.lstrip()
                    self.after_reasoning = not self.buf
                    if not self.buf:
                        break
                if self.features.tools:
                    opener = self._until(TOOL_OPENERS, "content", "tools", out, final)
                    if opener is not None:
                        self.tool_text = opener
                else:
                    out.append(("content", self.buf))
                    self.buf = ""
            else:  # tools: everything is call text until the end
                self.tool_text += self.buf
                self.buf = ""
            if before == (self.mode, len(self.buf)):
                break
        return [p for p in out if p[1]]

    def _until(
        self, tags: tuple[str, ...], kind: str, then: str, out: list[tuple[str, str]], final: bool
    ) -> str | None:
        """Emit `kind` text up to the first of `tags` and switch to `then` (returning the tag
        found), or emit all but a tail that could still begin one of them."""
        found = [(at, tag) for tag in tags if (at := self.buf.find(tag)) >= 0]
        if found:
            at, tag = min(found)
            out.append((kind, self.buf[:at]))
            self.buf = self.buf[at + len(tag) :]
            self.mode = then
            return tag
        keep = 0 if final else max(held_tag_prefix(self.buf, tag) for tag in tags)
        out.append((kind, self.buf[: len(self.buf) - keep]))
        self.buf = self.buf[len(self.buf) - keep :]
        return None
