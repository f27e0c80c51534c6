"""Chat templates that try to hang or exhaust the daemon are stopped, quickly and cheaply,
with a one-line TemplateError; good templates render exactly as plain jinja renders them.

The bombs run in one child process (so the peak RSS it reports is theirs alone, and an
address-space limit keeps a bomb that got through from taking this machine with it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from datetime import datetime

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from colibrid.engine.chat_template import ChatTemplate, Limits, TemplateLimitError
from colibrid.engine.tokenizer import TextCodec
from colibrid.errors import TemplateError

ORIGIN = "/models/bomb"
BOMBS: dict[str, tuple[str, str]] = {  # name: (template, the limit its error names)
    "str repeat": ("{{ 'A' * 4000000000 }}", "size limit of 1,048,"),
    "list repeat": ("{{ [0] * 4000000000 }}", "size limit of 1,048,"),
    "list of big strings joined": (
        "{% set a = 'A' * 1000000 %}{{ ([a] * 1000) | join }}",
        "size limit of",
    ),
    "range": ("{% for i in range(100000000) %}{% endfor %}", "range limit of 100,000 items"),
    "empty nested loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "time limit of 2 s",
    ),
    "power": ("{{ 10 ** (10 ** 8) }}", "number limit of 4,096 bits"),
    "format width": ("{{ '{:>999999999}'.format(1) }}", "size limit of"),
    "printf width": ("{{ '%999999999d' % 1 }}", "size limit of"),
    "center filter": ("{{ 'x' | center(999999999) }}", "size limit of"),
    "ljust": ("{{ 'x'.ljust(999999999) }}", "size limit of"),
    "replace everywhere": (
        "{% set a = 'A' * 100000 %}{{ a.replace('A', a) }}",
        "size limit of",
    ),
    "recursive macro": (
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "recursion limit",
    ),
    "lots of output": (
        "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
        "output limit of 1,048,",
    ),
    "doubling by ~": (
        "{% set ns = namespace(a='A' * 1000) %}"
        "{% for i in range(40) %}{% set ns.a = ns.a ~ ns.a %}{% endfor %}",
        "size limit of",
    ),
    "doubling by list literals": (
        "{% set ns = namespace(a=['x' * 1000]) %}"
        "{% for i in range(60) %}{% set ns.a = [ns.a, ns.a] %}{% endfor %}{{ ns.a == ns.a }}",
        "size limit of",
    ),
    "captured block of new strings": (
        "{% set a = 'A' * 1000000 %}"
        "{% set x %}{% for i in range(100000) %}{{ a ~ i }}{% endfor %}{% endset %}",
        "work limit of",
    ),
}

CHILD = textwrap.dedent(
    """
    import json, resource, sys, time
    vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    limit = vm + (1 << 30)  # a bomb that gets through fails here instead of eating the host
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from colibrid.engine.chat_template import TemplateLimitError
    from colibrid.engine.tokenizer import TextCodec
    TextCodec(None, chat_template="{{ 'warm' ~ messages|length }}").render_chat(
        [{"role": "user", "content": "hi"}]
    )
    results = {}
    for name, source in json.load(sys.stdin).items():
        codec = TextCodec(None, chat_template=source, origin=sys.argv[1])
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.monotonic()
        try:
            codec.render_chat([{"role": "user", "content": "hi"}])
            error = kind = code = None
        except Exception as exc:
            error, kind, code = str(exc), type(exc).__name__, getattr(exc, "code", None)
        results[name] = {
            "seconds": time.monotonic() - started,
            "error": error,
            "kind": kind,
            "code": code,
            "grew_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024,
        }
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def bomb_results() -> dict[str, dict]:
    sources = {name: source for name, (source, _) in BOMBS.items()}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, ORIGIN],
        input=json.dumps(sources),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout)


@pytest.mark.parametrize("name", list(BOMBS))
def test_bomb_is_a_quick_one_line_template_error(bomb_results: dict, name: str) -> None:
    result = bomb_results[name]
    _, limit = BOMBS[name]
    assert result["kind"] == "TemplateLimitError" and result["code"] == "TEMPLATE", result
    error = result["error"]
    assert error.startswith(f"chat template of {ORIGIN} went over its {limit}"), error
    assert "\n" not in error
    assert result["seconds"] < 3, result
    assert result["grew_mb"] < 200, result


# ---- what must still work ------------------------------------------------------------------
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'"
    " + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ECHO = "{% for m in messages %}{{ m.content }}{% endfor %}"


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_a_large_prompt_still_renders() -> None:
    """The output limit grows with the input: a 3 MB message on a 4k-context model."""
    big = "word " * 600_000
    codec = TextCodec(None, chat_template=CHATML, max_context=4096)
    text = codec.render_chat(user(big))
    assert text == f"<|im_start|>user\n{big}<|im_end|>\n<|im_start|>assistant\n"
    twice = TextCodec(None, chat_template=ECHO + ECHO, max_context=4096)
    assert twice.render_chat(user(big)) == big * 2
    # ...but it stays a limit: three copies of the input are more than a prompt needs
    thrice = TextCodec(None, chat_template=ECHO * 3, max_context=4096, origin="/m")
    with pytest.raises(TemplateLimitError, match="^chat template of /m went over its output"):
        thrice.render_chat(user(big))


def hf_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders with (what tokenizer.py used before)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = (
        lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


GOOD = {
    "chatml": CHATML,
    "macros, namespace, loop": (
        "{% macro turn(m) %}<{{ m.role | upper }}>{{ m.content | trim }}{% endmacro %}"
        "{% set ns = namespace(n=0, seen=[]) %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% set ns.seen = ns.seen + [m.role] %}"
        "{{ turn(m) }}{{ '|' if not loop.last }}{% endfor %}"
        "[{{ ns.n }} {{ ns.seen | join(',') }} {{ ns.seen }}]"
    ),
    "formatting": (
        "{{ '%s=%05d' % ('n', 42) }} {{ '{:>8}|{:<4}|{}'.format('a', 'b', 1700000000) }} "
        "{{ '%d' | format(1700000000) }} {{ 1700000000 | filesizeformat }} "
        "{{ 'x' | center(9) }}|{{ 'ab'.ljust(5) }}|{{ 3 * 'ab' }}|{{ [1, 2] * 2 }}|{{ 2 ** 10 }}"
    ),
    "tools and json": (
        "{% for t in tools %}{{ t | tojson }}\n{{ t | tojson(indent=2) }}{% endfor %}"
        "{{ {'k': messages[0]['content'], 'list': (1, 2)} }} {{ messages | map(attribute='role') "
        "| list }} {{ messages | selectattr('role', 'equalto', 'user') | list | length }}"
    ),
    "captures and filters": (
        "{% set body %}{% for m in messages %}{{ m.content ~ loop.index }}\n{% endfor %}"
        "{% endset %}{{ body | indent(2) }}{{ body | replace('\n', ' / ') }}"
        "{% filter upper %}{{ messages[-1].content }}{% endfilter %}"
        "{{ messages[-1].content.split(' ') | reverse | join('-') }}"
        "{{ range(3) | list }}{{ body | wordwrap(10) }}"
    ),
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Bonjour 🙂, ça va? <|im_end|> 日本語"},
    {"role": "assistant", "content": "  Oui!  "},
    {"role": "user", "content": "and you think so too"},
]
TOOLS = [{"type": "function", "function": {"name": "météo", "parameters": {"ville": "Zürich"}}}]


@pytest.mark.parametrize("name", list(GOOD))
def test_good_templates_render_as_plain_jinja(name: str) -> None:
    variables = {"messages": CONVERSATION, "tools": TOOLS, "add_generation_prompt": True}
    expected = hf_environment().from_string(GOOD[name]).render(**variables)
    got = ChatTemplate(GOOD[name], "/m").render(Limits(1 << 20), variables)
    assert got == expected


def test_the_template_can_still_refuse_a_conversation() -> None:
    codec = TextCodec(
        None,
        chat_template="{% if messages[0].role == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}ok",
        origin="/m",
    )
    assert codec.render_chat(user("hi")) == "ok"
    with pytest.raises(TemplateError) as info:
        codec.render_chat([{"role": "system", "content": "x"}, *user("hi")])
    assert not isinstance(info.value, TemplateLimitError)
    assert str(info.value) == "chat template of /m failed: System role not supported"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ 10.0 ** 1000 }}", "OverflowError"),
        ("{{ messages[0].nothing.deeper }}", "has no attribute 'nothing'"),
        ("{{ messages.__class__.__mro__ }}", "unsafe"),
    ],
)
def test_other_failures_are_one_line_template_errors(source: str, message: str) -> None:
    with pytest.raises(TemplateError, match=message) as info:
        TextCodec(None, chat_template=source, origin="/m").render_chat(user("hi"))
    assert str(info.value).startswith("chat template of /m failed: ")
    assert "\n" not in str(info.value) and info.value.code == "TEMPLATE"


def test_a_previous_tracer_is_restored_and_keeps_tracing() -> None:
    """Coverage tools and debuggers trace with sys.settrace: the render borrows it."""
    calls: list[str] = []

    def tracer(frame, event, arg):  # noqa: ANN001, ANN202
        calls.append(frame.f_code.co_name)

    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    codec = TextCodec(None, chat_template=spin)
    codec.template_time_s = 0.2
    sys.settrace(tracer)
    try:
        started = time.monotonic()
        with pytest.raises(TemplateLimitError, match="time limit of 0.2 s"):
            codec.render_chat(user("hi"))
        TextCodec(None, chat_template=CHATML).render_chat(user("hi"))
        after = sys.gettrace()
        user("traced")
    finally:
        sys.settrace(None)
    assert after is tracer
    assert time.monotonic() - started < 1.5
    assert "user" in calls
