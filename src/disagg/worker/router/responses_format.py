"""Response objects and stream events of the Responses API (pure), with the interface of
`openai_format.ResponseBuilder` so the router's generation path serves both.

The output is a list of items: a `message` with one `output_text` part for the text, and one
`function_call` item per tool call (parsed by `tools.ToolCalls`, as chat does). Streamed, the
events follow OpenAI's order: response.created, response.in_progress, then per item
output_item.added, (content_part.added, output_text.delta..., output_text.done,
content_part.done | function_call_arguments.delta, function_call_arguments.done),
output_item.done, and response.completed (response.incomplete when cut by max_output_tokens,
response.failed when a worker failed).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

from disagg.worker.router.errors import APIError
from disagg.worker.router.tools import ToolCalls


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(usage: dict) -> dict:
    """Chat's usage body in the Responses API's names."""
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _function_call(call: dict, status: str, arguments: str | None = None) -> dict:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if arguments is None else arguments,
        "status": status,
    }


class ResponsesBuilder:
    """Builds one Responses API request's response object, or its stream of events."""

    want_logprobs = False  # the Responses API's logprobs come with `include`, refused here

    def __init__(self, spec, tools: ToolCalls | None = None):
        self.req = spec.request
        self.model = spec.model
        self.tools = tools
        self.id = _id("resp")
        self.created_at = int(time.time())
        self._seq = 0
        self._output: list[dict] = []  # streamed: the items done so far
        self._msg: dict | None = None  # streamed: the message item being written
        self._text = ""
        self._finish = "stop"

    @classmethod
    def for_spec(cls, spec, token_text: Callable[[int], str], tools: ToolCalls | None) -> ResponsesBuilder:
        return cls(spec, tools)

    def _response(
        self, status: str, output: list[dict], usage: dict | None, error: dict | None = None
    ) -> dict:
        r = self.req
        fmt = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else None
        tool_choice = r.tool_choice if r.tool_choice is not None else ("auto" if r.tools else "none")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": r.temperature,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "top_p": r.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": r.user,
            "metadata": r.metadata or {},
        }

    @staticmethod
    def _status(finish: str) -> str:
        return "incomplete" if finish == "length" else "completed"

    # ---- whole response -----------------------------------------------------------------
    def choice(self, index: int, text: str, logprobs, finish_reason: str) -> dict:
        """The output items of the (single) generation."""
        content, calls = text, []
        if self.tools is not None:
            message, finish_reason = self.tools.message(text, finish_reason)
            content, calls = message["content"], message.get("tool_calls", [])
        status = self._status(finish_reason)  # a call cut by the limit is incomplete too
        items = []
        if content is not None and (content or not calls):
            items.append(_message(_id("msg"), content, status))
        items += [_function_call(c, status) for c in calls]
        return {"index": index, "output": items, "status": status}

    def response(self, choices: list[dict], usage: dict) -> dict:
        (choice,) = choices  # the Responses API has no `n`
        return self._response(choice["status"], choice["output"], responses_usage(usage))

    # ---- streaming ------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> bytes:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()

    def stream_start(self) -> bytes:
        r = self._response("in_progress", [], None)
        return self._event("response.created", response=r) + self._event("response.in_progress", response=r)

    def stream_chunk(
        self,
        text: str,
        logprobs,
        finish_reason: str | None,
        include_usage: bool,
        index: int = 0,
        usage: dict | None = None,  # the Responses API sends usage in its final event only
    ) -> bytes:
        calls: list[dict] = []
        if self.tools is not None:
            text, fields, finish_reason = self.tools.stream(index, text, finish_reason)
            calls = fields.get("tool_calls", [])
        out = b""
        if text:
            out += self._open_message()
            self._text += text
            out += self._event("response.output_text.delta", item_id=self._msg["id"], output_index=len(self._output),
                               content_index=0, delta=text, logprobs=[])  # fmt: skip
        if finish_reason is None:
            return out
        self._finish = "stop" if calls and finish_reason != "length" else finish_reason
        if self._msg is None and not calls:
            out += self._open_message()  # an empty answer is still a message
        if self._msg is not None:
            out += self._close_message()
        for call in calls:
            out += self._stream_call(call)
        return out

    def _open_message(self) -> bytes:
        if self._msg is not None:
            return b""
        self._msg = _message(_id("msg"), None, "in_progress")
        where = {"item_id": self._msg["id"], "output_index": len(self._output), "content_index": 0}
        return self._event("response.output_item.added", output_index=len(self._output), item=self._msg) + \
            self._event("response.content_part.added", **where, part=_text_part(""))  # fmt: skip

    def _close_message(self) -> bytes:
        where = {"item_id": self._msg["id"], "output_index": len(self._output), "content_index": 0}
        part = _text_part(self._text)
        item = {**self._msg, "status": self._status(self._finish), "content": [part]}
        out = self._event("response.output_text.done", **where, text=self._text, logprobs=[])
        out += self._event("response.content_part.done", **where, part=part)
        out += self._event("response.output_item.done", output_index=len(self._output), item=item)
        self._output.append(item)
        return out

    def _stream_call(self, call: dict) -> bytes:
        i = len(self._output)
        added = _function_call(call, "in_progress", arguments="")
        done = {**added, "arguments": call["function"]["arguments"], "status": self._status(self._finish)}
        out = self._event("response.output_item.added", output_index=i, item=added)
        out += self._event("response.function_call_arguments.delta", item_id=added["id"], output_index=i,
                           delta=done["arguments"])  # fmt: skip
        out += self._event("response.function_call_arguments.done", item_id=added["id"], output_index=i,
                           arguments=done["arguments"])  # fmt: skip
        out += self._event("response.output_item.done", output_index=i, item=done)
        self._output.append(done)
        return out

    def stream_end(self, usage: dict | None) -> bytes:
        status = self._status(self._finish)
        r = self._response(status, self._output, responses_usage(usage) if usage else None)
        return self._event(
            "response.completed" if status == "completed" else "response.incomplete", response=r
        )

    def stream_error(self, err: APIError) -> bytes:
        # the `error` event carries this server's own code; a failed response's code is one of
        # the few OpenAI defines
        out = self._event("error", code=err.code or err.type, message=err.message, param=err.param)
        code = {400: "invalid_prompt", 429: "rate_limit_exceeded"}.get(err.status, "server_error")
        error = {"code": code, "message": err.message}
        return out + self._event(
            "response.failed", response=self._response("failed", self._output, None, error)
        )
