"""The grammar worker: a process of its own in which the daemon compiles grammars.

Why a process (colibrid.engine.grammar): compiling a crafted grammar can overflow the
stack, allocate without bound or run for minutes, inside native code no Python guard
stops. Here that ends this process at worst: it runs under an address-space limit
(RLIMIT_AS, so a runaway allocation fails instead of swapping the machine; Rust then
aborts) and without core dumps; the daemon (colibrid.serve.grammars) gives each request
a deadline, kills the process when it is missed, reads EOF when it crashed, answers that
one request "grammar too complex: ..." and starts another process for the next. Grammars
compile on a thread with a large stack, so a deep but legitimate grammar still fits.

Protocol, one JSON object a line each way on stdin/stdout (`python -m
colibrid.engine.grammar_worker MEMORY_MB`):

    {"op": "ping"} -> {"ok": true}     (the process is up, its imports done)
    {"op": "tokenizer", "key": K, "json": TOKENIZER_JSON, "n_vocab": N, "eos": [ids]}
        -> {"ok": true} | {"error": MESSAGE}
    {"op": "compile", "kind": K, "form": F, "text": T, "tokenizer": K | null}
        -> {"source": S} | {"error": MESSAGE}

A compile names the tokenizer it is for (the last one sent; the worker keeps one): the
grammar is then also built into a matcher for that vocabulary and asked for its first
mask, which is all the work the daemon repeats in-process afterwards.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
from collections.abc import Callable
from typing import Any

STACK_BYTES = 256 << 20  # the compiling thread's stack (reserved, touched only as used)


class _State:
    def __init__(self) -> None:
        self.key: str | None = None
        self.tokenizer: Any = None


def handle(request: dict[str, Any], state: _State) -> dict[str, Any]:
    from colibrid.engine.grammar import Grammar, llg_tokenizer
    from colibrid.errors import ColibriError

    try:
        if request["op"] == "ping":
            return {"ok": True}
        if request["op"] == "tokenizer":
            state.key, state.tokenizer = None, None
            state.tokenizer = llg_tokenizer(
                request["json"], request["n_vocab"], frozenset(request["eos"])
            )
            state.key = request["key"]
            return {"ok": True}
        wanted = request.get("tokenizer")
        if wanted is not None and wanted != state.key:
            return {"error": "the grammar worker lost the model's tokenizer; send it again"}
        grammar = Grammar(request["kind"], request["form"], request["text"])
        compiled = grammar.compile(state.tokenizer if wanted is not None else None)
        return {"source": compiled.source}
    except ColibriError as exc:
        return {"error": str(exc)}
    except MemoryError:
        return {"error": "grammar too complex: compiling it ran out of memory"}


def _on_big_stack(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    result: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: result.append(fn()), name="compile")
    thread.start()
    thread.join()
    return result[0] if result else {"error": "the grammar compiler failed"}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    memory = int(args[0]) << 20 if args else 0
    import llguidance  # noqa: F401  (imported before the limit: its own mapping is not the grammar's)

    from colibrid.engine import grammar  # noqa: F401

    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    threading.stack_size(STACK_BYTES)
    state = _State()
    out = sys.stdout
    for line in sys.stdin:
        try:
            request = json.loads(line)
        except ValueError:
            return 2  # the daemon never sends this: the pipe is not ours
        reply = _on_big_stack(lambda request=request: handle(request, state))
        out.write(json.dumps(reply, ensure_ascii=False) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    os.environ["RUST_BACKTRACE"] = "0"
    sys.exit(main())
