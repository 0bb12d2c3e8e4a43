"""Tool calling on chat completions: what a request's `tools` and `tool_choice` (or the legacy
`functions` and `function_call`) mean for the prompt, the sampling and the response.

  none      the tools are shown to the model (chat template's `tools`), the output is text
  auto      the output is parsed for calls by the router's `--tool-call-parser`
  required  the output is constrained to a JSON array of calls {"name", "parameters"} (one
            only when parallel_tool_calls is false), as vLLM does it
  named     the output is constrained to that function's parameters schema

A response with calls has `tool_calls` (legacy: `function_call`), content null unless the model
wrote text before them, and finish_reason "tool_calls" ("function_call"; "stop" for a named
function, as OpenAI answers). A forced call cut by max_tokens is still a call, as OpenAI reports
it: finish_reason "length" and the arguments written so far in `tool_calls`, never as content. Streamed, text flows until a call may have started; the calls
follow as `tool_calls` deltas when the generation ends.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from disagg.worker.engine.structured_output_params import StructuredOutputParams
from disagg.worker.router.errors import APIError, invalid
from disagg.worker.router.tool_parsers import PARSERS, ParsedCall


@dataclass
class ToolSpec:
    tools: list[dict]  # OpenAI's {"type": "function", "function": {...}}, as templates take them
    mode: str  # none | auto | required | named
    named: str | None = None
    parallel: bool = True
    legacy: bool = False  # asked with functions / function_call: answer with function_call

    def structured_output(self) -> StructuredOutputParams | None:
        if self.mode == "named":
            fn = next(t["function"] for t in self.tools if t["function"]["name"] == self.named)
            return StructuredOutputParams(json=json.dumps(fn.get("parameters") or {"type": "object"}))
        if self.mode != "required":
            return None
        calls = [
            {"type": "object",
             "properties": {"name": {"enum": [t["function"]["name"]]},
                            "parameters": t["function"].get("parameters") or {"type": "object"}},
             "required": ["name", "parameters"], "additionalProperties": False}
            for t in self.tools
        ]  # fmt: skip
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputParams(json=json.dumps(schema))


def tool_spec(req) -> ToolSpec | None:
    """The request's tools and choice (a `ChatCompletionRequest`), or None without tools."""
    if req.tools is not None and req.functions is not None:
        raise invalid("functions", "'functions' is the legacy form of 'tools': give one of them")
    legacy = req.functions is not None
    if legacy:
        fns = req.functions
        choice = req.function_call
        if req.tool_choice is not None:
            raise invalid(
                "tool_choice", "'tool_choice' goes with 'tools'; with 'functions' use 'function_call'"
            )
    else:
        fns = [t.function for t in req.tools or []]
        choice = req.tool_choice
        if req.function_call is not None:
            raise invalid(
                "function_call", "'function_call' goes with 'functions'; with 'tools' use 'tool_choice'"
            )
    param = "function_call" if legacy else "tool_choice"
    if not fns:
        if choice not in (None, "none"):
            raise invalid(param, f"'{param}' needs {'functions' if legacy else 'tools'}")
        return None
    names = [f.name for f in fns]
    if len(set(names)) != len(names):
        raise invalid("functions" if legacy else "tools", "function names must be unique")
    tools = [{"type": "function", "function": f.model_dump(exclude_none=True, by_alias=True)} for f in fns]
    if choice is None or isinstance(choice, str):
        mode, named = choice or "auto", None
    else:
        mode, named = "named", choice.name if legacy else choice.function.name
        if named not in names:
            raise invalid(param, f"'{param}' names the function {named!r}, which is not among the tools")
    parallel = req.parallel_tool_calls is not False and not legacy
    return ToolSpec(tools, mode, named, parallel, legacy)


@dataclass
class _Stream:
    text: str = ""
    sent: int = 0  # characters of `text` sent as content
    started: bool = False  # a call has started: hold the rest


@dataclass
class ToolCalls:
    """The response side of one request's tools: parse calls, whole or streamed."""

    spec: ToolSpec
    parser_name: str | None
    _streams: dict[int, _Stream] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.spec.mode == "auto" and self.parser_name is None:
            raise APIError(
                400,
                "'tool_choice' 'auto' needs a tool-call parser: start the router with --tool-call-parser "
                f"({' or '.join(PARSERS)}), or use tool_choice 'required' or a named function",
                param="tool_choice" if not self.spec.legacy else "function_call",
            )
        self.parser = PARSERS.get(self.parser_name) if self.parser_name else None

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        mode = self.spec.mode
        if mode == "none":
            return text, []
        if mode == "named":  # the arguments, whole or cut short (finish_reason says which)
            return None, [ParsedCall(self.spec.named, text)]
        if mode == "required":
            try:
                calls = [ParsedCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                         for c in json.loads(text)]  # fmt: skip
            except (ValueError, TypeError, KeyError):
                return None, _cut_calls(text)  # cut short (length): the calls so far
            return None, calls
        return self.parser.parse(text)

    def finish_reason(self, calls: list[ParsedCall], finish: str) -> str:
        # a forced call cut by the limit is reported as cut (OpenAI's "length")
        if not calls or (finish == "length" and self.spec.mode in ("named", "required")):
            return finish
        if self.spec.legacy:
            return "function_call"
        return "stop" if self.spec.mode == "named" else "tool_calls"

    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """The whole response's message and finish reason."""
        content, calls = self.parse(text)
        msg: dict = {"role": "assistant", "content": content, "refusal": None}
        if calls and self.spec.legacy:
            msg["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
        elif calls:
            msg["tool_calls"] = [_call_body(c) for c in calls]
        return msg, self.finish_reason(calls, finish)

    def stream(self, index: int, text: str, finished: str | None) -> tuple[str, dict, str | None]:
        """One streamed delta of choice `index`: (content to send, the delta's call fields,
        finish reason). Content before a call's start is sent as it comes (hermes); the calls
        themselves go out whole with the last delta."""
        s = self._streams.setdefault(index, _Stream())
        s.text += text
        if self.spec.mode == "none":
            return text, {}, finished
        out = ""
        if not s.started and self.spec.mode == "auto":
            upto, s.started = self.parser.stream_split(s.text)
            upto = max(upto, s.sent)
            out, s.sent = s.text[s.sent : upto], upto
        if finished is None:
            return out, {}, None
        content, calls = self.parse(s.text)
        if not calls:  # no call after all: the held text is content (none, for a forced call)
            return out + (s.text[s.sent :] if content is not None else ""), {}, finished
        if self.spec.legacy:
            fields = {"function_call": {"name": calls[0].name, "arguments": calls[0].arguments}}
        else:
            fields = {"tool_calls": [{"index": i, **_call_body(c)} for i, c in enumerate(calls)]}
        return out, fields, self.finish_reason(calls, finished)


_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_PARAMETERS = re.compile(r'"parameters"\s*:\s*')


def _cut_calls(text: str) -> list[ParsedCall]:
    """The calls of a `required` array cut short: the whole ones, then the last one with its name
    and the arguments written so far (cut before its name: not reported, there is no call yet)."""
    start = text.find("[")
    if start < 0:
        return []
    calls, pos, decoder = [], start + 1, json.JSONDecoder()
    while True:
        while pos < len(text) and text[pos] in " \t\n\r,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            calls.append(ParsedCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
    rest = text[pos:]
    name, params = _NAME.search(rest), _PARAMETERS.search(rest)
    if name is None:
        return calls
    if params is None:
        arguments = ""
    elif params.start() < name.start():  # the arguments came first: they end where the name starts
        arguments = rest[params.end() : name.start()].rstrip().rstrip(",").rstrip()
    else:
        arguments = rest[params.end() :]
    return [*calls, ParsedCall(json.loads(name.group(1)), arguments)]


def _call_body(c: ParsedCall) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": c.name, "arguments": c.arguments}}  # fmt: skip
