"""A Responses API request -> the chat `GenerationSpec` (pure): the same engine path, template,
tool calling and structured output as `/v1/chat/completions`.

`instructions` become the system message, `input` the conversation (a string is one user
message; `function_call` items become an assistant message's tool calls and
`function_call_output` items tool messages), `text.format` the `response_format`, function
tools the chat tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from disagg.worker.router import protocol
from disagg.worker.router.errors import APIError, invalid
from disagg.worker.router.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ResponsesRequest,
)
from disagg.worker.router.tools import tool_spec
from disagg.worker.router.validation import GenerationSpec, _parse, _sampling


@dataclass
class ResponsesSpec(GenerationSpec):
    request: ResponsesRequest | None = None  # echoed back in the response object


def parse_responses(body: Any) -> ResponsesSpec:
    """A Responses request (raw JSON bytes, or the decoded object) -> its spec."""
    req = _parse(ResponsesRequest, body)
    chat = _as_chat(req)
    try:
        sampling = _sampling(chat, req.max_output_tokens, None)
    except APIError as e:  # an invalid schema: name the field as this request spells it
        e.message = e.message.replace("response_format.json_schema.schema", "text.format.schema")
        e.message = e.message.replace("response_format", "text.format")
        e.param = "text.format.schema" if e.param and "schema" in e.param else "text.format"
        raise
    tools = tool_spec(chat)
    forced = tools.structured_output() if tools is not None else None
    if forced is not None:
        if sampling.structured_output is not None:
            raise invalid("tool_choice", "a forced tool call cannot be combined with 'text.format'")
        sampling.structured_output = forced
    return ResponsesSpec(
        kind="chat",
        model=req.model,
        sampling=sampling,
        stream=req.stream,
        include_usage=True,  # response.completed always carries the usage
        messages=messages(req),
        tools=tools,
        user=req.user,
        request=req,
    )


def _as_chat(req: ResponsesRequest) -> protocol.ChatCompletionRequest:
    """The chat request this one amounts to, for the sampling, structured output and tools."""
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None:
        schema = None
        if fmt.type == "json_schema":
            schema = protocol.JSONSchemaFormat(name=fmt.name, description=fmt.description, schema=fmt.schema_,
                                               strict=fmt.strict)  # fmt: skip
        response_format = protocol.ResponseFormat(type=fmt.type, json_schema=schema)
    tools = None
    if req.tools is not None:
        tools = [
            protocol.Tool(type="function", function=protocol.FunctionDef(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
            for t in req.tools
        ]  # fmt: skip
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = protocol.NamedToolChoice(type="function", function=protocol.FunctionName(name=choice.name))
    # model_construct (the other fields at their defaults): these were validated as the
    # Responses request's own
    return protocol.ChatCompletionRequest.model_construct(
        model=req.model, messages=[], temperature=req.temperature, top_p=req.top_p,
        response_format=response_format, tools=tools, tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls,
    )  # fmt: skip


def messages(req: ResponsesRequest) -> list[dict]:
    """The conversation as the chat templates take it."""
    out: list[dict] = []
    if req.instructions is not None:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        out.append({"role": "user", "content": req.input})
        return out
    for item in req.input:
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _arguments(item.arguments)}}  # fmt: skip
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": item.text()})
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: the template gets the text
