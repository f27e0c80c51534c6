"""Grammars as clients send them (JSON schema, Lark, regex): checked for shape and size at
the edge, compiled by llguidance somewhere that may fail.

A `Grammar` is what a request asked for, not yet compiled: building one costs a walk of
the schema or a scan of the text against the caps below, never a call into llguidance.
Compiling (`Grammar.compile`) is the part a crafted grammar can turn against the daemon:
llguidance's validator recurses once per rule or `$ref` (a long enough chain overflows the
stack and kills the process), and deciding whether intersected patterns (`allOf`) can
match grows exponentially with their number. So the daemon only ever compiles in its
grammar worker process (`grammar_worker`, driven by `colibrid.serve.grammars`), under a
deadline and an address-space limit, and the caps here refuse the obvious bombs before
anything is compiled. Tests and one-shot tools may compile in-process.

Errors are one line each, with llguidance's own internals (parser states, regex trees)
left out: `public_message`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from colibrid.errors import RequestError, contain_panics

FORMS = ("json_schema", "lark", "regex")
# JSON as models write it (`{"a": 1, "b": [2, 3]}`) and nothing else: flexible whitespace
# lets a small model wander into blank lines until max_tokens. A schema's own
# "x-guidance" options win over these.
JSON_STYLE: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

# ---- structural caps, checked before anything is compiled (docs/configuration.md) -------
MAX_TEXT_BYTES = 256 * 1024  # a grammar's text (a schema as JSON, Lark, a regex)
MAX_SCHEMA_NODES = 20_000  # objects, arrays and values in one JSON schema
MAX_DEFINITIONS = 1_000  # entries of `$defs` / `definitions`, all levels together
MAX_REF_DEPTH = 128  # `$ref`s followed one inside another (the validator recurses per step)
MAX_INTERSECTED_PATTERNS = 10  # `pattern`s one `allOf` intersects (cost grows ~2x each)
MAX_LARK_RULES = 1_000  # rules and terminals of a Lark grammar
MAX_REGEX_CHARS = 8 * 1024
MAX_MESSAGE = 300  # characters of an error message a client reads

_RULE_LINE = re.compile(r"^\s*[?!]?[A-Za-z_][A-Za-z0-9_]*(\.-?\d+)?\s*:", re.MULTILINE)
_POINTER_LINE = re.compile(r"^\s*(\d+\s*\||\^)")  # the source excerpt under a Lark error
# Where llguidance's message turns into its internals: a regex tree, parser state dumps.
_INTERNALS = re.compile(r"\s*(\(And |\(Or |\(Not |\(SearchRegex|⟦|<state>|NoExtensionBias).*")


def public_message(message: str) -> str:
    """llguidance's message as a client should read it: one bounded line, without its
    source excerpt, regex trees or parser states."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    text = "; ".join(ln for ln in lines if not _POINTER_LINE.match(ln))
    text = _INTERNALS.sub("", text).rstrip(" :;")
    if text.startswith("Unable to determine if regex is empty"):
        text = (
            "grammar too complex: cannot decide whether its patterns can match "
            "(intersected patterns, e.g. `allOf` with `pattern`s, cost too much)"
        )
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def styled_schema(schema: Mapping[str, Any] | bool) -> dict[str, Any] | bool:
    """`schema` with `JSON_STYLE` as its x-guidance defaults (what `%json{...}` inside a
    Lark grammar needs, since only a top-level JSON schema takes options)."""
    if isinstance(schema, bool):
        return schema
    own = schema.get("x-guidance")
    style = {**JSON_STYLE, **own} if isinstance(own, Mapping) else JSON_STYLE
    return {**schema, "x-guidance": style}


@dataclass(frozen=True)
class CompiledGrammar:
    """llguidance's compiled form of a `Grammar` (`source`), valid for any tokenizer;
    `kind` is the request's label for it (the DONE line's `grammar=`)."""

    kind: str
    source: str


@dataclass(frozen=True)
class Grammar:
    """What a request's answer must look like: `form` (what llguidance compiles:
    json_schema, lark, regex), `text` (the schema as JSON, the Lark text, the regex) and
    `kind`, the label the client knows it by (json_schema, lark, regex, tool_call).
    Build with `json_schema`, `lark`, `regex` or `from_spec`; each raises RequestError
    for a wrong shape or a grammar past the caps, and compiles nothing."""

    kind: str
    form: str
    text: str

    @property
    def key(self) -> str:
        """The grammar's content digest: what compiles the same has the same key."""
        return hashlib.sha256(f"{self.form}\0{self.text}".encode()).hexdigest()

    @classmethod
    def json_schema(cls, schema: Any, *, kind: str = "json_schema") -> Grammar:
        if not isinstance(schema, (dict, bool)):
            raise RequestError("a JSON schema must be an object (or true/false)")
        if isinstance(schema, dict):
            check_schema_size(schema)
        text = json.dumps(schema, ensure_ascii=False)
        _check_bytes(text, "JSON schema")
        return cls(kind, "json_schema", text)

    @classmethod
    def lark(cls, text: Any, *, kind: str = "lark") -> Grammar:
        if not isinstance(text, str) or not text.strip():
            raise RequestError("a Lark grammar must be a non-empty string")
        _check_bytes(text, "Lark grammar")
        rules = len(_RULE_LINE.findall(text))
        if rules > MAX_LARK_RULES:
            raise RequestError(
                f"grammar too complex: the Lark grammar has {rules} rules (at most "
                f"{MAX_LARK_RULES})"
            )
        return cls(kind, "lark", text)

    @classmethod
    def regex(cls, text: Any) -> Grammar:
        if not isinstance(text, str) or not text:
            raise RequestError("a regex must be a non-empty string")
        if len(text) > MAX_REGEX_CHARS:
            raise RequestError(
                f"grammar too complex: the regex has {len(text)} characters (at most "
                f"{MAX_REGEX_CHARS})"
            )
        return cls("regex", "regex", text)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Grammar:
        """`{"json_schema": {...}}`, `{"lark": "..."}` or `{"regex": "..."}` (SERVE's
        grammar payload, `colibri ask --json-schema | --grammar`)."""
        keys = [k for k in spec if k in FORMS]
        if len(spec) != 1 or len(keys) != 1:
            raise RequestError(
                'a grammar is one of {"json_schema": {...}}, {"lark": "..."}, {"regex": "..."}'
            )
        kind = keys[0]
        value = spec[kind]
        if kind == "json_schema":
            return cls.json_schema(value)
        return cls.lark(value) if kind == "lark" else cls.regex(value)

    def compile(self, tokenizer: Any = None) -> CompiledGrammar:
        """llguidance's compiled grammar, validated (and, given the model's `LLTokenizer`,
        built into a matcher once and asked for its first mask, so that what the daemon
        builds afterwards is known to succeed); RequestError with the reason otherwise.
        Unbounded in time and memory and able to crash the process: the daemon calls
        it only inside its grammar worker."""
        import llguidance

        what = {"json_schema": "JSON schema", "lark": "Lark grammar", "regex": "regex"}[self.form]
        with contain_panics(f"compiling the {what}"):
            try:
                if self.form == "json_schema":
                    source = llguidance.LLMatcher.grammar_from_json_schema(
                        self.text, defaults=JSON_STYLE
                    )
                elif self.form == "lark":
                    source = llguidance.LLMatcher.grammar_from_lark(self.text)
                else:
                    source = llguidance.LLMatcher.grammar_from_regex(self.text)
            except (ValueError, TypeError) as exc:
                raise RequestError(f"invalid {what}: {public_message(str(exc))}") from None
            problem = llguidance.LLMatcher.validate_grammar(source, limits=parser_limits())
            if problem:
                raise RequestError(_invalid(what, problem))
            if tokenizer is not None:
                matcher = llguidance.LLMatcher(
                    tokenizer, source, log_level=0, limits=parser_limits()
                )
                if not matcher.is_error():
                    matcher.compute_bitmask()
                if matcher.is_error():
                    raise RequestError(_invalid(what, matcher.get_error()))
        return CompiledGrammar(self.kind, source)


def llg_tokenizer(tokenizer_json: str, n_vocab: int, stop_ids: frozenset[int]) -> Any:
    """The model's tokenizer as llguidance needs it (to know each token's bytes);
    `n_vocab` is the model's logits size, `stop_ids` the tokens that end an answer.
    RequestError when llguidance cannot use it."""
    import llguidance

    with contain_panics("reading the tokenizer for grammars"):
        try:
            return llguidance.LLTokenizer(
                tokenizer_json, n_vocab=n_vocab, eos_token=sorted(stop_ids) or None
            )
        except Exception as exc:  # the Rust side raises plain exceptions
            raise RequestError(
                f"this model's tokenizer cannot drive a grammar: {public_message(str(exc))}"
            ) from None


def parser_limits() -> Any:
    """llguidance's limits as the daemon runs it: its defaults, but errors that never
    quote the parser's state (clients read them)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def _invalid(what: str, problem: str) -> str:
    message = public_message(problem)
    return message if message.startswith("grammar too complex") else f"invalid {what}: {message}"


def _check_bytes(text: str, what: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TEXT_BYTES:
        raise RequestError(
            f"grammar too complex: the {what} is {size} bytes (at most {MAX_TEXT_BYTES})"
        )


# ---- the schema walk --------------------------------------------------------------------
def _children(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        yield from node.values()
    elif isinstance(node, list):
        yield from node


def check_schema_size(schema: dict[str, Any]) -> None:
    """Refuses (RequestError "grammar too complex: ...") a schema past the caps: too many
    nodes or definitions, `$ref`s nested deeper than MAX_REF_DEPTH, an `allOf` that
    intersects more than MAX_INTERSECTED_PATTERNS patterns. One pass and a walk of the
    `$ref` graph, without recursion (the schema may be as deep as the body allows)."""
    nodes = definitions = 0
    refs: list[dict[str, Any]] = []
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise RequestError(
                f"grammar too complex: the JSON schema has more than {MAX_SCHEMA_NODES} nodes"
            )
        if isinstance(node, dict):
            for key in ("$defs", "definitions"):
                if isinstance(node.get(key), dict):
                    definitions += len(node[key])
            if isinstance(node.get("$ref"), str):
                refs.append(node)
            if isinstance(node.get("allOf"), list):
                _check_intersection(node)
        stack.extend(_children(node))
    if definitions > MAX_DEFINITIONS:
        raise RequestError(
            f"grammar too complex: the JSON schema has {definitions} definitions "
            f"(at most {MAX_DEFINITIONS})"
        )
    if refs:
        depth = _ref_depth(schema)
        if depth > MAX_REF_DEPTH:
            raise RequestError(
                f"grammar too complex: the JSON schema's $refs nest {depth} deep "
                f"(at most {MAX_REF_DEPTH})"
            )


def _check_intersection(node: dict[str, Any]) -> None:
    """The patterns one `allOf` (with its nested `allOf`s) asks a string to match at once."""
    patterns = 0
    stack: list[Any] = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            patterns += isinstance(item.get("pattern"), str)
            members = item.get("allOf")
            if isinstance(members, list):
                stack.extend(members)
    if patterns > MAX_INTERSECTED_PATTERNS:
        raise RequestError(
            f"grammar too complex: an allOf intersects {patterns} patterns (at most "
            f"{MAX_INTERSECTED_PATTERNS})"
        )


def _resolve(root: Any, ref: str) -> Any:
    """The node a local `$ref` ("#/a/b", JSON pointer) names, else None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _refs_below(node: Any, budget: list[int]) -> list[str]:
    """The `$ref` strings inside `node`, not counting the definitions it holds (those are
    reached by reference, not by containment)."""
    found: list[str] = []
    stack = [node]
    while stack:
        item = stack.pop()
        budget[0] -= 1
        if budget[0] < 0:
            raise RequestError("grammar too complex: the JSON schema's $refs cross too often")
        if isinstance(item, dict):
            if isinstance(item.get("$ref"), str):
                found.append(item["$ref"])
            stack.extend(v for k, v in item.items() if k not in ("$defs", "definitions"))
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _ref_depth(root: dict[str, Any]) -> int:
    """The longest chain of `$ref`s followed one inside another from the root (a
    reference back into the chain is recursion, which llguidance builds lazily: it ends
    the chain). Iterative depth-first search with memoised depths."""
    budget = [20 * MAX_SCHEMA_NODES]
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    targets: dict[int, list[Any]] = {}

    def below(node: Any) -> list[Any]:
        if id(node) not in targets:
            resolved = (_resolve(root, ref) for ref in _refs_below(node, budget))
            targets[id(node)] = [t for t in resolved if t is not None]
        return targets[id(node)]

    stack: list[tuple[Any, int]] = [(root, 0)]
    on_path.add(id(root))
    while stack:
        node, index = stack[-1]
        children = below(node)
        if index < len(children):
            stack[-1] = (node, index + 1)
            child = children[index]
            if id(child) not in depth and id(child) not in on_path:
                on_path.add(id(child))
                stack.append((child, 0))
            continue
        stack.pop()
        on_path.discard(id(node))
        depth[id(node)] = max(
            (1 + depth.get(id(c), 0) for c in children if id(c) in depth), default=0
        )
    return depth[id(root)]
