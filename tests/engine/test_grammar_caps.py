"""The structural caps a grammar meets before anything compiles it (engine.grammar): each
refuses the shape that hurts (long `$ref` chains, intersected patterns, huge rule sets)
and lets the legitimate neighbours of that shape through (recursive schemas, many
independent definitions, patterns in `anyOf`); llguidance's internals never reach a
client's message."""

from __future__ import annotations

import pytest

from colibrid.engine import grammar as g
from colibrid.engine.grammar import Grammar, public_message
from colibrid.errors import RequestError


def chain(n: int) -> dict:
    defs = {
        f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def refused(build, words: str) -> None:  # noqa: ANN001
    with pytest.raises(RequestError) as err:
        build()
    assert str(err.value).startswith("grammar too complex") and words in str(err.value)
    assert "\n" not in str(err.value)


def test_ref_chains_are_measured_and_capped() -> None:
    Grammar.json_schema(chain(g.MAX_REF_DEPTH - 2)).compile()
    refused(lambda: Grammar.json_schema(chain(g.MAX_REF_DEPTH + 5)), "$refs nest")


def test_recursion_and_wide_definitions_pass() -> None:
    tree = {
        "$ref": "#/$defs/node",
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
    }
    Grammar.json_schema(tree).compile()
    wide = {
        "type": "object",
        "properties": {f"p{i}": {"$ref": f"#/$defs/d{i}"} for i in range(500)},
        "$defs": {f"d{i}": {"type": "integer"} for i in range(500)},
    }
    assert g._ref_depth(wide) == 1
    Grammar.json_schema(wide)


def test_counts_are_capped() -> None:
    many = {"$defs": {f"d{i}": {"type": "integer"} for i in range(g.MAX_DEFINITIONS + 1)}}
    refused(lambda: Grammar.json_schema(many), "definitions")
    nodes = {"enum": list(range(g.MAX_SCHEMA_NODES))}
    refused(lambda: Grammar.json_schema(nodes), "nodes")
    rules = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(g.MAX_LARK_RULES))
    refused(lambda: Grammar.lark(rules + f'r{g.MAX_LARK_RULES}: "x"\n'), "rules")
    refused(lambda: Grammar.regex("a" * (g.MAX_REGEX_CHARS + 1)), "characters")
    refused(lambda: Grammar.lark('start: "' + "x" * g.MAX_TEXT_BYTES + '"'), "bytes")


def test_intersected_patterns_are_capped_but_alternatives_are_not() -> None:
    def patterns(n: int) -> list[dict]:
        return [{"pattern": f".*{chr(97 + i)}.*"} for i in range(n)]

    limit = g.MAX_INTERSECTED_PATTERNS
    Grammar.json_schema({"type": "string", "allOf": patterns(limit)})
    refused(
        lambda: Grammar.json_schema({"type": "string", "allOf": patterns(limit + 1)}),
        f"intersects {limit + 1} patterns",
    )
    nested = {"allOf": [{"allOf": patterns(limit)}, {"pattern": "x.*"}]}
    refused(lambda: Grammar.json_schema(nested), "allOf intersects")
    Grammar.json_schema({"anyOf": patterns(limit * 3)})


def test_internals_never_reach_a_message() -> None:
    tree = "Unable to determine if regex is empty:  (And (And (SearchRegex /.*a.*/) ..."
    assert "(And" not in public_message(tree) and "too complex" in public_message(tree)
    state = "parser failed; NoExtensionBias; <state>; Tokens: ⟦x⟧"
    assert public_message(state) == "parser failed"
    assert len(public_message("x" * 1000)) == g.MAX_MESSAGE
    lark = 'at 1(8): unknown name: "foo"\n   1 | start: foo\n           ^'
    assert public_message(lark) == 'at 1(8): unknown name: "foo"'


def test_the_content_key_tells_grammars_apart() -> None:
    a = Grammar.json_schema({"type": "string"})
    assert a.key == Grammar.json_schema({"type": "string"}).key
    assert a.key != Grammar.json_schema({"type": "integer"}).key
    assert Grammar.regex("x").key != Grammar.lark('start: "x"').key
