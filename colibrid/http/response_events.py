"""The scheduler's events as Responses API objects: the streamed events (response.created,
response.in_progress, output items opened and closed around their deltas, then
response.completed or response.incomplete, each with its `sequence_number`) or, not
streaming, the one Response object they add up to. Pure, no I/O.

Output items follow the generated text as the splitter cuts it: reasoning text is a
``reasoning`` item (``response.reasoning_text.delta``), the answer a ``message`` item
(``response.output_text.delta``), and the tool calls, known once the output is complete
(as on /v1/chat/completions), ``function_call`` items with their arguments in one delta.
A response that ends without any of them still has its (empty) message, so a client's
``output_text`` is always there. An answer the length limit cut is ``incomplete`` with
``incomplete_details.reason = "max_output_tokens"``, its items too. Asked for, the
logprobs of the tokens since the previous delta go with each text delta (and all of the
message's with its part); those of reasoning text are not listed, a reasoning item having
no place for them.

A finished response (not a failed one) is kept in the `ResponseStore` when its request
said `store` (the default), as the conversation a later `previous_response_id` continues.
"""

from __future__ import annotations

import time
from typing import Any

from colibri_protocol.messages import Logprobs

from colibrid.http.logprobs import ChatLogprobs
from colibrid.http.openai import Plan, whole
from colibrid.http.parsing import ToolCall
from colibrid.http.response_store import ResponseStore
from colibrid.http.responses import ResponseSpec, new_id
from colibrid.http.splitter import make_splitter
from colibrid.serve.events import Done

Event = tuple[str, dict[str, Any]]  # (type, payload): sse.named frames them


class ResponseStream:
    """Events -> Responses streaming events `(type, payload)` or one Response object."""

    def __init__(self, plan: Plan, spec: ResponseSpec, store: ResponseStore) -> None:
        self.plan = plan
        self.spec = spec
        self.store = store
        self.created = int(time.time())
        self.splitter = make_splitter(plan.features)
        self.output: list[dict[str, Any]] = []
        self.open: str | None = None  # "message" | "reasoning": the item being written
        self.sequence = 0
        self.reasoning_tokens = 0  # tokens whose text was reasoning
        self.calls: list[ToolCall] = []
        self.final: dict[str, Any] = {}  # the Response object, once finished
        on = plan.request.params.logprobs is not None
        self.logprobs = ChatLogprobs() if on else None

    # ---- the Response object ---------------------------------------------------------------
    def _response(self, status: str, done: Done | None = None) -> dict[str, Any]:
        spec = self.spec
        incomplete = status == "incomplete"
        return {
            "id": spec.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": spec.instructions,
            "max_output_tokens": self.plan.max_tokens,
            "metadata": spec.metadata,
            "model": self.plan.model,
            "output": [dict(item) for item in self.output] if done else [],
            "parallel_tool_calls": spec.parallel_tool_calls,
            "previous_response_id": spec.previous_response_id,
            "prompt_cache_key": spec.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None},
            "safety_identifier": spec.safety_identifier,
            "service_tier": "default",
            "store": spec.store,
            "temperature": spec.temperature,
            "text": {"format": spec.text_format},
            "tool_choice": spec.tool_choice,
            "tools": list(spec.tools),
            "top_p": spec.top_p,
            "truncation": "disabled",
            "usage": self._usage(done) if done else None,
            "user": spec.user,
        }

    def _usage(self, done: Done) -> dict[str, Any]:
        return {
            "input_tokens": done.prompt_tokens,
            # the prompt's KV is kept for the conversation's next turn (the prompt cache):
            # what was not reused was written
            "input_tokens_details": {
                "cached_tokens": done.cached_tokens,
                "cache_write_tokens": done.prompt_tokens - done.cached_tokens,
            },
            "output_tokens": done.generated_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": done.prompt_tokens + done.generated_tokens,
        }

    def _event(self, kind: str, **payload: Any) -> Event:
        self.sequence += 1
        return kind, {**payload, "sequence_number": self.sequence - 1}

    # ---- output items ----------------------------------------------------------------------
    def _item(self) -> dict[str, Any]:
        return self.output[-1]

    def _open(self, kind: str) -> list[Event]:
        """Open a message or reasoning item, with its one content part."""
        self.open = kind
        if kind == "message":
            item = {
                "id": new_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {
                "id": new_id("rs"),
                "type": "reasoning",
                "status": "in_progress",
                "summary": [],
                "content": [],
            }
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        index = len(self.output) - 1
        events = [self._event("response.output_item.added", output_index=index, item=dict(item))]
        item["content"] = [part]
        events.append(
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=dict(part),
            )
        )
        return events

    def _close(self, status: str) -> list[Event]:
        if self.open is None:
            return []
        kind, self.open = self.open, None
        item, index = self._item(), len(self.output) - 1
        part = item["content"][0]
        item["status"] = status
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if kind == "message":
            done = self._event(
                "response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]
            )
        else:
            done = self._event("response.reasoning_text.done", **where, text=part["text"])
        return [
            done,
            self._event("response.content_part.done", **where, part=dict(part)),
            self._event("response.output_item.done", output_index=index, item=_copy(item)),
        ]

    def _pieces(self, pieces: list[tuple[str, str]]) -> list[Event]:
        events: list[Event] = []
        for kind, text in pieces:
            want = "reasoning" if kind == "reasoning" else "message"
            if self.open != want:
                events += self._close("completed")
                events += self._open(want)
            part = self._item()["content"][0]
            part["text"] += text
            where = {"item_id": self._item()["id"], "output_index": len(self.output) - 1}
            entries = self._pending()  # the tokens since the last delta: this text's
            if want == "message":
                part["logprobs"] += entries
                events.append(
                    self._event(
                        "response.output_text.delta",
                        **where,
                        content_index=0,
                        delta=text,
                        logprobs=entries,
                    )
                )
            else:
                events.append(
                    self._event(
                        "response.reasoning_text.delta", **where, content_index=0, delta=text
                    )
                )
        return events

    def _call(self, call: ToolCall) -> list[Event]:
        arguments = call.arguments_json
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": new_id("call"),
            "name": call.name,
            "arguments": "",
        }
        self.output.append(item)
        index = len(self.output) - 1
        where = {"item_id": item["id"], "output_index": index}
        events = [
            self._event("response.output_item.added", output_index=index, item=dict(item)),
            self._event("response.function_call_arguments.delta", **where, delta=arguments),
        ]
        item.update(arguments=arguments, status="completed")
        return events + [
            self._event(
                "response.function_call_arguments.done",
                **where,
                name=call.name,
                arguments=arguments,
            ),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]

    # ---- the translator's interface (app._pump) ----------------------------------------------
    def start(self) -> list[Event]:
        head = self._response("in_progress")
        return [
            self._event("response.created", response=head),
            self._event("response.in_progress", response=head),
        ]

    def _pending(self) -> list[dict[str, Any]]:
        pending = None if self.logprobs is None else self.logprobs.pending()
        return [] if pending is None else pending["content"]

    def token(self, text: str, logprobs: Logprobs | None = None) -> list[Event]:
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.add(logprobs)
        pieces = self.splitter.feed(text) if text else []
        if any(kind == "reasoning" for kind, _ in pieces):
            self.reasoning_tokens += 1
        return self._pieces(pieces)

    def finish(self, done: Done) -> list[Event]:
        pieces, calls = self.splitter.finish(whole=whole(self.plan, done))
        self.calls = calls if self.spec.parallel_tool_calls else calls[:1]
        status = "incomplete" if done.finish == "length" and not self.calls else "completed"
        events = self._pieces(pieces)
        if self.open == "message":  # tokens held back to the end (a stop string's start)
            self._item()["content"][0]["logprobs"] += self._pending()
        if not any(item["type"] == "message" for item in self.output) and not self.calls:
            events += self._close("completed") + self._open("message")  # always an answer
        events += self._close(status)
        for call in self.calls:
            events += self._call(call)
        self.final = final = self._response(status, done)
        if self.spec.store:
            self.store.keep(self.spec.id, self.spec.conversation + (self._turn(),))
        return events + [self._event(f"response.{status}", response=final)]

    def response(self, done: Done) -> dict[str, Any]:
        self.finish(done)
        return self.final

    def failed(self, error: dict[str, Any]) -> list[Event]:
        """A request that failed after its stream began: ``response.failed`` carries the
        error, its code one of the API's (a full queue is `rate_limit_exceeded`, anything
        else `server_error`; the message says what happened)."""
        events = self._close("incomplete")
        code = "rate_limit_exceeded" if error.get("type") == "rate_limit_error" else "server_error"
        final = {
            **self._response("failed"),
            "output": [dict(item) for item in self.output],
            "error": {"code": code, "message": error["message"]},
        }
        return events + [self._event("response.failed", response=final)]

    def _turn(self) -> dict[str, Any]:
        """The answer as the chat message a next turn's template shows."""
        texts = {"message": [], "reasoning": []}
        for item in self.output:
            if item["type"] in texts:
                texts[item["type"]].append(item["content"][0]["text"])
        turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts["message"])}
        if texts["reasoning"]:
            turn["reasoning_content"] = "".join(texts["reasoning"])
        calls = [
            {
                "type": "function",
                "id": item["call_id"],
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for item, call in zip(
                (i for i in self.output if i["type"] == "function_call"), self.calls, strict=True
            )
        ]
        if calls:
            turn["tool_calls"] = calls
        return turn


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item with its content parts copied (later deltas must not change a sent one)."""
    return {**item, "content": [dict(p) for p in item["content"]]}
