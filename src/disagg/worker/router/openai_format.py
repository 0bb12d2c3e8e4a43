"""OpenAI response bodies and stream chunks for completions and chat completions (pure)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from disagg.worker.router.errors import APIError
from disagg.worker.router.tools import ToolCalls


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


@dataclass
class Logprob:
    token_id: int
    logprob: float | None  # None: an echoed prompt's first token, which has no context
    top: list[tuple[int, float]] = field(default_factory=list)


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(items: list[Logprob], token_text: Callable[[int], str], text_offset: int) -> dict:
    """The legacy completions shape: parallel lists plus a dict of alternatives per position, which
    always holds the chosen token too (as OpenAI's does; with logprobs=0 it is the only entry)."""
    tokens, lps, tops, offsets = [], [], [], []
    pos = text_offset
    for it in items:
        t = token_text(it.token_id)
        tokens.append(t)
        lps.append(it.logprob)
        top = None
        if it.logprob is not None:
            top = {token_text(tid): lp for tid, lp in it.top}
            top.setdefault(t, it.logprob)
        tops.append(top)
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(items: list[Logprob], token_text: Callable[[int], str]) -> dict:
    def entry(tid: int, lp: float) -> dict:
        t = token_text(tid)
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

    return {
        "content": [
            {**entry(it.token_id, it.logprob), "top_logprobs": [entry(tid, lp) for tid, lp in it.top]}
            for it in items
        ],
        "refusal": None,
    }


class ResponseBuilder:
    """Builds the JSON objects of one request, streamed or not, for any number of choices."""

    def __init__(
        self,
        kind: str,
        model: str,
        token_text: Callable[[int], str],
        want_logprobs: bool,
        tools: ToolCalls | None = None,
    ):
        self.kind = kind
        self.tools = tools  # chat with tools: calls parsed out of the text
        self.model = model
        self.id = new_id(kind)
        self.created = int(time.time())
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self._text_offset: dict[int, int] = {}  # per choice: where its next streamed text starts
        self._sent_role: set[int] = set()  # chat choices whose first chunk (with the role) went out

    @classmethod
    def for_spec(cls, spec, token_text: Callable[[int], str], tools: ToolCalls | None) -> ResponseBuilder:
        return cls(spec.kind, spec.model, token_text, spec.sampling.logprobs is not None, tools)

    def _logprobs(self, items: list[Logprob], text_offset: int) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.kind == "chat":
            return chat_logprobs(items, self.token_text)
        return completion_logprobs(items, self.token_text, text_offset)

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    # ---- streaming --------------------------------------------------------------------
    def chunk(
        self,
        text: str,
        logprobs: list[Logprob],
        finish_reason: str | None,
        include_usage: bool,
        index: int = 0,
        usage: dict | None = None,
    ) -> dict:
        offset = self._text_offset.get(index, 0)
        lp = self._logprobs(logprobs, offset)
        if self.kind == "chat":
            fields: dict = {}
            if self.tools is not None:
                text, fields, finish_reason = self.tools.stream(index, text, finish_reason)
            delta: dict = {"content": text, **fields}
            if index not in self._sent_role:
                delta = {"role": "assistant", **delta}
                self._sent_role.add(index)
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        self._text_offset[index] = offset + len(text)
        if include_usage:
            body["usage"] = usage  # None but with continuous_usage_stats
        return body

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = usage
        return body

    # the stream as bytes: the router writes these (the Responses API's builder has its own)
    def stream_start(self) -> bytes:
        return b""

    def stream_chunk(
        self, text, logprobs, finish_reason, include_usage: bool, index: int = 0, usage: dict | None = None
    ) -> bytes:
        return sse(self.chunk(text, logprobs, finish_reason, include_usage, index, usage))

    def stream_end(self, usage: dict | None) -> bytes:
        return (sse(self.usage_chunk(usage)) if usage is not None else b"") + SSE_DONE

    def stream_error(self, err: APIError) -> bytes:
        return sse(err.body())

    # ---- whole response ---------------------------------------------------------------
    def choice(self, index: int, text: str, logprobs: list[Logprob], finish_reason: str) -> dict:
        lp = self._logprobs(logprobs, 0)
        if self.kind == "chat":
            message = {"role": "assistant", "content": text, "refusal": None}
            if self.tools is not None:
                message, finish_reason = self.tools.message(text, finish_reason)
            return {
                "index": index,
                "message": message,
                "logprobs": lp,
                "finish_reason": finish_reason,
            }
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}

    def response(self, choices: list[dict], usage: dict) -> dict:
        """The whole response; `choices` from `choice()`, put in index order here."""
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        body = self._envelope(obj, sorted(choices, key=lambda c: c["index"]))
        body["usage"] = usage
        return body

    def full(self, text: str, logprobs: list[Logprob], finish_reason: str, usage: dict) -> dict:
        """The whole response of a single-choice request."""
        return self.response([self.choice(0, text, logprobs, finish_reason)], usage)


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")
