"""Tool-call parsers for `tool_choice: auto`: find the calls a model wrote in its own format (chosen
by the router's `--tool-call-parser`, as vLLM's flag). Pure text in, (content, calls) out.

  llama3_json: the whole output is `{"name": ..., "parameters": {...}}` (optionally after
               `<|python_tag|>`), several separated by `;`, as Llama 3.1+ emit them.
  hermes:      `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, with free text
               before them (Hermes, Qwen 2/2.5/3).

`stream_split(text)` tells a streaming response how much of the text so far is certainly content
(flush it) and whether a tool call has started (hold the rest until the end).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def _call(obj, args_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class Llama3JsonParser:
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls

    def stream_split(self, text: str) -> tuple[int, bool]:
        body = text.lstrip()
        if body.startswith("{") or body.startswith(self.PYTHON_TAG):
            return 0, True
        if not body or self.PYTHON_TAG.startswith(body):
            return 0, False  # not decided yet: hold it
        return len(text), False  # calls only come first: this is content


class HermesParser:
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for body in self._BLOCK.findall(text[start:]):
            try:
                call = _call(json.loads(body.strip()), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:start].strip()
        return content or None, calls

    def stream_split(self, text: str) -> tuple[int, bool]:
        start = text.find(self.START)
        if start >= 0:
            return start, True
        # hold back a tail that may be the beginning of the tag
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-k:]):
                return len(text) - k, False
        return len(text), False


PARSERS = {p.name: p for p in (Llama3JsonParser(), HermesParser())}
