"""Chat templates rendered the way transformers renders them, but under limits.

A checkpoint's chat template is a program written by whoever published the model, and
it runs inside the daemon. Jinja's sandbox keeps it away from Python internals, but not
from asking for `'A' * 4000000000` (a 4 GB string), `10 ** (10 ** 8)`, a recursive
macro or two nested `range(100000)` loops: one such request would hang the engine
thread or take the daemon's memory. `BoundedEnvironment` refuses those before they run:

- every operation that can make a large value in one step (`*`, `+`, `%`, `~`, `**`,
  a list or dict literal, a filter, a method call, a block or macro buffer) has its
  result estimated first and is refused when that is over the output limit;
- an integer argument larger than the output limit (a width, a count) is refused;
- `range` stops at jinja's own 100,000 items, with a clean error;
- a render-wide work budget bounds the total characters built, so a loop that keeps
  making values it never prints still stops;
- a deadline, enforced by a trace function installed only in the rendering thread and
  only during the render, stops loops that build nothing at all.

Every failure inside a render, limits or not, becomes one `TemplateError` line naming
the model; limits are a `TemplateLimitError`, which the load-time probe turns into a
refusal of the model. Good templates render byte-identically to transformers.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import re
import string
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator, Frame
from jinja2.nodes import Concat, Dict, List, Tuple
from jinja2.runtime import BlockReference
from jinja2.sandbox import ImmutableSandboxedEnvironment

from colibrid.errors import CheckpointError, TemplateError, first_line

log = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT = 131072  # when the context of the model is not known
DEFAULT_TIME_S = 2.0
OUTPUT_FLOOR = 65536  # a tiny context still leaves room for a template's fixed text
MAX_RANGE = 100_000  # jinja's sandbox limit, which transformers' templates live with
MAX_INT_BITS = 4096
WORK_FACTOR = 8  # total characters built, in outputs: re-printing a macro's text is fine
_TEMPLATE_FILE = "<template>"  # the file name jinja compiles `from_string` code under


def output_limit(max_context: int, input_chars: int) -> int:
    """Characters a render may produce: eight per token of context (no real prompt
    needs more) plus twice the input, so a legitimately large prompt still renders."""
    return max(8 * max_context, OUTPUT_FLOOR) + 2 * input_chars


@dataclass(frozen=True)
class Limits:
    """The bounds of one render."""

    output_chars: int
    time_s: float = DEFAULT_TIME_S

    @classmethod
    def for_chat(
        cls,
        max_context: int,
        messages: Any,
        tools: Any = None,
        *,
        time_s: float = DEFAULT_TIME_S,
    ) -> Limits:
        size = approx_len(messages, math.inf) + approx_len(tools, math.inf)
        return cls(output_limit(max_context, size), time_s)

    @property
    def work_chars(self) -> int:
        return WORK_FACTOR * self.output_chars


class TemplateLimitError(TemplateError):
    """The template went over a limit (size, time, range, recursion): a bomb, not a
    template that dislikes this conversation. The load-time probe refuses the model."""


class _Over(Exception):
    """Raised inside a render when a limit is reached; becomes a TemplateLimitError.
    Not a subclass of anything jinja catches, so the template cannot swallow it."""

    def __init__(self, kind: str, limit: str, detail: str = "") -> None:
        super().__init__(f"{kind} limit of {limit}" + (f" ({detail})" if detail else ""))


def _chars(n: float) -> str:
    return f"{n:,.0f}" if n < 1e18 else f"about 10^{math.log10(n):.0f}"


# ---- how big a value is ---------------------------------------------------------------------
_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))


def approx_len(value: Any, cap: float) -> float:
    """About `len(str(value))`, counting a shared element once per reference (as printing
    it would), computed only until it passes `cap`. Cheap for strings (their length);
    for containers memoised by identity, so a value built by doubling costs its depth."""
    if isinstance(value, (str, bytes)):  # the common case, without the closure
        return len(value)
    memo: dict[int, tuple[Any, float]] = {}  # holds each value, so no id is reused

    def size(v: Any) -> float:
        if isinstance(v, (str, bytes)):
            return len(v)
        if isinstance(v, jinja2.utils.Namespace):
            v = object.__getattribute__(v, "_Namespace__attrs")
        elif not isinstance(v, (list, tuple, dict, set, frozenset, *_VIEWS)):
            return _scalar_len(v)
        key = id(v)
        if key in memo:
            return memo[key][1]
        total = 2.0
        for item in itertools.chain.from_iterable(v.items()) if isinstance(v, dict) else v:
            # scalars inline: a call per element would cost a trace event each
            if isinstance(item, str):
                total += len(item) + 4
            elif isinstance(item, (int, float)) and item.__class__ is not bool:
                total += 26 if isinstance(item, float) else item.bit_length() * 0.302 + 4
            else:
                total += size(item) + 2
            if total > cap:
                break
        memo[key] = (v, total)
        return total

    return size(value)


def _scalar_len(v: Any) -> float:
    if v is None or isinstance(v, (bool, float)):
        return 24
    if isinstance(v, int):
        return v.bit_length() * 0.302 + 2
    return 0 if isinstance(v, jinja2.Undefined) else 64


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")


def _percent_size(fmt: str, values: Any) -> float:
    """An upper estimate of `fmt % values` (printf-style, also the `format` filter)."""
    if isinstance(values, tuple):
        args: list[Any] = list(values)
    elif isinstance(values, Mapping):
        args = list(values.values())
    else:
        args = [values]
    widest = max((approx_len(a, math.inf) for a in args), default=0)
    total: float = len(fmt)
    for width, precision, conversion in _PERCENT.findall(fmt):
        if conversion == "%":
            continue
        total += widest + sum(int(n) for n in (width, precision) if n.isdigit())
    return total


def _format_size(fmt: str, values: Sequence[Any]) -> float:
    """An upper estimate of `fmt.format(*values)`: widths in the spec plus the widest
    value per field. A malformed format string is left to fail in the real call."""
    widest = max((approx_len(a, math.inf) for a in values), default=0)
    total: float = 0
    try:
        for literal, name, spec, _ in string.Formatter().parse(fmt):
            total += len(literal)
            if name is not None:
                total += widest + sum(int(n) for n in re.findall(r"\d+", spec or ""))
    except ValueError:
        return 0
    return total


def _nested_spec(fmt: str) -> bool:
    """Whether a format string takes a width from its values (`'{:>{}}'`)."""
    try:
        return any("{" in (spec or "") for _, _, spec, _ in string.Formatter().parse(fmt))
    except ValueError:
        return False


# ---- the state of one render ----------------------------------------------------------------
@dataclass
class _Guard:
    """The limits, deadline and work done of the render running in this thread."""

    limits: Limits
    deadline: float = math.inf
    work: float = 0

    def expect(self, size: float, what: str) -> None:
        """Refuse an operation whose result would be `size` characters."""
        if size > self.limits.output_chars:
            raise _Over(
                "size",
                f"{_chars(self.limits.output_chars)} characters",
                f"{what} would make {_chars(size)}",
            )

    def made(self, value: Any) -> Any:
        """Count a value the template built; refuse it when it is too big."""
        size = approx_len(value, self.limits.output_chars)
        self.expect(size, "a value")
        self.work += size
        if self.work > self.limits.work_chars:
            raise _Over("work", f"{_chars(self.limits.work_chars)} characters", "built in all")
        return value

    def numbers(self, name: str, args: Iterable[Any]) -> None:
        """Refuse an integer argument larger than the output limit (a width, a count)."""
        for value in args:
            if _is_int(value) and abs(value) > self.limits.output_chars:
                raise _Over(
                    "size",
                    f"{_chars(self.limits.output_chars)} characters",
                    f"an argument of {_chars(abs(value))} to {name}",
                )

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Over("time", f"{self.limits.time_s:g} s")

    def tracer(self) -> Callable[[types.FrameType, str, Any], Any]:
        """A sys.settrace hook: every call checks the deadline, and template code is traced
        line by line, so a loop that calls nothing is stopped too. Closures, not methods:
        they run on every line of the template, and a call fewer is most of their cost."""
        clock = time.monotonic
        guard = self

        def line(frame: types.FrameType, event: str, arg: Any) -> Any:
            if clock() > guard.deadline:
                guard.check_time()
            return line

        def call(frame: types.FrameType, event: str, arg: Any) -> Any:
            if clock() > guard.deadline:
                guard.check_time()
            return line if frame.f_code.co_filename == _TEMPLATE_FILE else None

        return call


def _range(*args: int) -> range:
    """jinja's `safe_range`, failing with the limit rather than an OverflowError."""
    rng = range(*args)
    n = max(0, -((rng.start - rng.stop) // rng.step))  # len() overflows past 2**63
    if n > MAX_RANGE:
        raise _Over("range", f"{MAX_RANGE:,} items", f"range of {_chars(n)} items")
    return rng


# ---- sizes of the calls that can grow a value ----------------------------------------------
def _text_method_size(owner: str | bytes, name: str, args: tuple, kwargs: dict) -> float | None:
    """The result size of a str/bytes method that can grow its text; None when it
    cannot grow it (or the arguments are wrong, which the real call reports)."""
    try:
        if name == "replace":
            old, new = args[0], args[1]
            count = args[2] if len(args) > 2 else kwargs.get("count", -1)
            hits = len(owner) + 1 if not old else owner.count(old)
            if _is_int(count) and count >= 0:
                hits = min(hits, count)
            return len(owner) + hits * max(len(new) - len(old), 0)
        if name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            return len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * tab
        if name == "translate" and isinstance(args[0], Mapping):
            widest = max((approx_len(v, math.inf) for v in args[0].values()), default=1)
            return len(owner) * max(widest, 1)
        if name == "join":
            items = args[0]
            return sum(approx_len(i, math.inf) for i in items) + len(owner) * len(items)
    except (IndexError, TypeError, AttributeError):
        return None
    return None


def _filter_size(name: str, args: tuple, kwargs: dict) -> float | None:
    """The result size of jinja's filters that can grow their input (arguments as jinja
    passes them, pass_arg first); None for the others."""
    try:
        if name == "join":  # (eval_ctx, value, d="", attribute=None)
            value = args[1]
            sep = args[2] if len(args) > 2 else kwargs.get("d", "")
            items = sum(approx_len(i, math.inf) for i in value)
            return items + approx_len(sep, math.inf) * len(value)
        if name == "replace":  # (eval_ctx, s, old, new, count=None)
            s, old, new = args[1], args[2], args[3]
            count = args[4] if len(args) > 4 else kwargs.get("count")
            text = s if isinstance(s, str) else None
            hits = text.count(old) if text is not None and old else approx_len(s, math.inf) + 1
            if _is_int(count) and count >= 0:
                hits = min(hits, count)
            return approx_len(s, math.inf) + hits * approx_len(new, math.inf)
        if name == "indent":  # (s, width=4, first=False, blank=False)
            s = args[0]
            width = args[1] if len(args) > 1 else kwargs.get("width", 4)
            lines = s.count("\n") + 1 if isinstance(s, str) else approx_len(s, math.inf)
            each = width if _is_int(width) else approx_len(width, math.inf)
            return approx_len(s, math.inf) + lines * each
        if name == "format":  # (value, *args, **kwargs)
            return _percent_size(str(args[0]), kwargs or tuple(args[1:]))
        if name == "wordwrap":  # (env, s, width=79, break_long_words=True, wrapstring=None)
            s = args[1]
            wrap = args[4] if len(args) > 4 else kwargs.get("wrapstring")
            n = approx_len(s, math.inf)
            return n + (n + 1) * approx_len(wrap if wrap is not None else "\n", math.inf)
        if name == "tojson":  # (x, ensure_ascii, indent, ...): indent widens each line
            indent = args[2] if len(args) > 2 else kwargs.get("indent")
            each = indent if _is_int(indent) else approx_len(indent, math.inf) if indent else 0
            n = approx_len(args[0], math.inf)
            return n * 6 * (1 + each) if each > 16 else n * 6
    except (IndexError, TypeError, AttributeError):
        return None
    return None


# Filters and callables whose integer arguments are sizes (a width, a count of items or
# paragraphs); elsewhere an integer is data (a timestamp) and may be as large as it likes.
_SIZE_FILTERS = frozenset(
    ["center", "indent", "wordwrap", "truncate", "batch", "slice", "round", "tojson"]
)


def _takes_sizes(obj: Any) -> bool:
    """str/bytes methods (center, ljust, zfill...), int.to_bytes and lipsum."""
    if obj is jinja2.utils.generate_lorem_ipsum:
        return True
    owner = getattr(obj, "__self__", None)
    return isinstance(obj, types.BuiltinMethodType) and isinstance(owner, (str, bytes, int, float))


# ---- the environment ------------------------------------------------------------------------
class _BoundedCodeGenerator(CodeGenerator):
    """Routes `~` and list/tuple/dict literals through the environment's size check, the
    only places a template makes values without a call or an intercepted operator."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        # jinja's visit_Concat, with the pieces checked before they are joined
        if frame.eval_ctx.volatile:
            func_name = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            func_name = "markup_join"
        else:
            func_name = "str_join"
        self.write(f"{func_name}(environment.check_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(")))")

    def visit_List(self, node: List, frame: Frame) -> None:
        self.write("environment.check_literal(")
        super().visit_List(node, frame)
        self.write(")")

    def visit_Dict(self, node: Dict, frame: Frame) -> None:
        self.write("environment.check_literal(")
        super().visit_Dict(node, frame)
        self.write(")")

    def visit_Tuple(self, node: Tuple, frame: Frame) -> None:
        if node.ctx == "store":  # an assignment target: `{% for k, v in ... %}`
            super().visit_Tuple(node, frame)
            return
        self.write("environment.check_literal(")
        super().visit_Tuple(node, frame)
        self.write(")")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' (and ours) does not.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' environment (immutable sandbox, trim/lstrip blocks, loop controls,
    its tojson, raise_exception and strftime_now) with every growing operation checked
    against the limits of the render running in the calling thread."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols],
            finalize=self._finalize,
        )
        self._local = threading.local()
        # Outside a render (constant folding at compile time) the default limits hold.
        self._idle = _Guard(Limits(output_limit(DEFAULT_MAX_CONTEXT, 0)))
        self.globals["range"] = _range
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.filters["tojson"] = _tojson
        for name, func in list(self.filters.items()):
            self.filters[name] = self._bounded_filter(name, func)

    # -- the render's state
    def guard(self) -> _Guard:
        return getattr(self._local, "guard", None) or self._idle

    def enter(self, guard: _Guard | None) -> None:
        self._local.guard = guard

    # -- hooks the generated code calls
    def _finalize(self, value: Any) -> Any:
        return self.guard().made(value)

    def check_concat(self, pieces: tuple) -> tuple:
        guard = self.guard()
        guard.expect(sum(approx_len(p, math.inf) for p in pieces), "'~'")
        return pieces

    def check_literal(self, value: Any) -> Any:
        return self.guard().made(value)

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        """Joins a macro's, block's or `{% set %}` body's buffer, refusing it once the
        pieces pass the limit (a loop appending one string many times costs nothing
        until it is joined)."""
        guard = self.guard()
        total = 0
        kept = []
        for piece in pieces:
            total += len(piece)
            guard.expect(total, "a captured block")
            kept.append(piece)
        return guard.made("".join(kept))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        guard = self.guard()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _is_int(n) and isinstance(seq, (str, bytes, list, tuple)) and n > 0:
                    guard.expect(approx_len(seq, math.inf) * n, "'*'")
            if _is_int(left) and _is_int(right):
                self._bits(left.bit_length() + right.bit_length(), "'*'")
        elif operator == "**":
            if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
                self._bits(right * math.log2(abs(left)), "'**'")
        elif operator == "+":
            if isinstance(left, (str, bytes, list, tuple)) and isinstance(
                right, (str, bytes, list, tuple)
            ):
                guard.expect(approx_len(left, math.inf) + approx_len(right, math.inf), "'+'")
        elif operator == "%" and isinstance(left, str):
            guard.expect(_percent_size(left, right), "'%' formatting")
            if "*" in left and isinstance(right, tuple):
                guard.numbers("'%'", right)  # `%*d` takes its width from the values
        return guard.made(self.binop_table[operator](left, right))

    @staticmethod
    def _bits(bits: float, what: str) -> None:
        if bits > MAX_INT_BITS:
            raise _Over("number", f"{MAX_INT_BITS:,} bits", f"{what} would make {_chars(bits)}")

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        guard = self.guard()
        name = getattr(obj, "__name__", type(obj).__name__)
        owner = getattr(obj, "__self__", None)
        if _takes_sizes(obj):
            guard.numbers(name, (*args, *kwargs.values()))
        if isinstance(obj, types.BuiltinMethodType) and isinstance(owner, (str, bytes)):
            if name == "join" and args and not isinstance(args[0], Sized):
                args = (list(args[0]), *args[1:])
            size = _text_method_size(owner, name, args, kwargs)
            if size is not None:
                guard.expect(size, f"{type(owner).__name__}.{name}")
        if isinstance(obj, BlockReference) and self.is_safe_callable(obj):
            # Its __call__ joins the block's pieces with environment.concat: bounded.
            return obj()
        return guard.made(super().call(context, obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__
        as_map = value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            values = (
                list(args[0].values())
                if as_map and args and isinstance(args[0], Mapping)
                else [*args, *kwargs.values()]
            )
            guard = self.guard()
            guard.expect(_format_size(fmt, values), f"str.{value.__name__}")
            if _nested_spec(fmt):
                guard.numbers(f"str.{value.__name__}", values)  # `{:{}}`: a width as a value
            return wrapped(*args, **kwargs)

        return functools.update_wrapper(bounded, wrapped)

    def _bounded_filter(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        """`func` with its integer arguments, its input and its result checked; the
        filters that can grow their input also have their result estimated first."""

        @functools.wraps(func)  # keeps jinja_pass_arg, which says what to pass first
        def bounded(*args: Any, **kwargs: Any) -> Any:
            guard = self.guard()
            if name in _SIZE_FILTERS:
                guard.numbers(f"the {name} filter", (*args, *kwargs.values()))
            if name == "join" and len(args) > 1 and not isinstance(args[1], Sized):
                args = (args[0], list(args[1]), *args[2:])
            for value in (*args, *kwargs.values()):
                guard.expect(approx_len(value, guard.limits.output_chars), f"the {name} filter")
            size = _filter_size(name, args, kwargs)
            if size is not None:
                guard.expect(size, f"the {name} filter")
            return guard.made(func(*args, **kwargs))

        return bounded


# ---- compiling and rendering ----------------------------------------------------------------
class ChatTemplate:
    """One compiled chat template of a model; `render` runs it under `Limits`."""

    def __init__(self, source: str, origin: str) -> None:
        self.origin = origin
        self._env = BoundedEnvironment()
        try:
            self._template = self._env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise CheckpointError(
                f"chat template of {origin} does not parse (line {exc.lineno}): {exc.message}"
            ) from None
        except Exception as exc:  # e.g. RecursionError on absurdly nested source
            raise CheckpointError(
                f"chat template of {origin} cannot be compiled: {first_line(exc)}"
            ) from None

    def render(self, limits: Limits, variables: Mapping[str, Any]) -> str:
        """The template's text for `variables`; TemplateLimitError past a limit,
        TemplateError for any other failure, each one line naming the model."""
        guard = _Guard(limits, deadline=time.monotonic() + limits.time_s)
        previous = sys.gettrace()
        self._env.enter(guard)
        pieces = self._template.generate(**variables)
        sys.settrace(guard.tracer())
        try:
            out: list[str] = []
            total = 0
            for piece in pieces:
                total += len(piece)
                if total > limits.output_chars:
                    raise _Over("output", f"{_chars(limits.output_chars)} characters")
                out.append(piece)
            return "".join(out)
        except _Over as exc:
            raise TemplateLimitError(
                f"chat template of {self.origin} went over its {exc}"
            ) from None
        except RecursionError:
            raise TemplateLimitError(
                f"chat template of {self.origin} went over its recursion limit "
                f"(a macro or loop calls itself too deeply)"
            ) from None
        except MemoryError:
            raise TemplateLimitError(f"chat template of {self.origin} ran out of memory") from None
        except jinja2.exceptions.TemplateError as exc:  # raise_exception, undefined, sandbox
            raise TemplateError(
                f"chat template of {self.origin} failed: {first_line(exc)}"
            ) from None
        except Exception as exc:
            raise TemplateError(
                f"chat template of {self.origin} failed: {type(exc).__name__}: {first_line(exc)}"
            ) from None
        finally:
            guard.deadline = math.inf  # closing the generator below must not time out
            sys.settrace(previous)
            self._env.enter(None)
            pieces.close()


# ---- the load-time probe ------------------------------------------------------------------
SAMPLE_CHAT: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
)
SAMPLE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city."}},
            "required": ["city"],
        },
    },
}


def probe(render: Callable[..., str], origin: str, *, mentions_tools: bool) -> None:
    """Render a small sample conversation (and one tool, when the template speaks of
    tools) so that a template which is a bomb for every request is refused when the
    model loads, in one line, instead of failing each request. A template that merely
    fails on the sample (it refuses a system role, say) is still served."""
    for tools in (None, [SAMPLE_TOOL]) if mentions_tools else (None,):
        try:
            render([dict(m) for m in SAMPLE_CHAT], tools=tools)
        except TemplateLimitError as exc:
            raise CheckpointError(f"{exc} on a sample chat; the model is refused") from None
        except (TemplateError, CheckpointError) as exc:
            log.debug("chat template of %s fails on the sample chat: %s", origin, exc)
