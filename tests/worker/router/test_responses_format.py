"""The Responses API's shapes without a cluster: `tool_choice: auto` calls parsed out of the text
(whole and streamed), events in order, the response objects valid against OpenAI's SDK types."""

from __future__ import annotations

import json

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from disagg.worker.router.responses_format import ResponsesBuilder
from disagg.worker.router.responses_request import parse_responses
from disagg.worker.router.tools import ToolCalls

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
CALL = '{"name": "get_weather", "parameters": {"city": "Lima"}}'
USAGE = {
    "prompt_tokens": 7,
    "completion_tokens": 3,
    "total_tokens": 10,
    "prompt_tokens_details": {"cached_tokens": 0},
}


def _builder(**body) -> ResponsesBuilder:
    spec = parse_responses({"model": "m", "input": "hi", **body})
    tools = ToolCalls(spec.tools, "llama3_json") if spec.tools is not None else None
    return ResponsesBuilder.for_spec(spec, str, tools)


def _events(raw: bytes) -> list[dict]:
    out = []
    for block in raw.decode().strip().split("\n\n"):
        event, data = block.split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert event == f"event: {body['type']}"
        TypeAdapter(ResponseStreamEvent).validate_python(body)  # OpenAI's own event types
        out.append(body)
    return out


def test_auto_tool_call_parsed_from_the_text():
    b = _builder(tools=[TOOL])
    body = b.response([b.choice(0, CALL, [], "stop")], USAGE)
    Response.model_validate(body)
    (call,) = body["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Lima"} and call["call_id"].startswith("call_")
    assert body["usage"]["input_tokens"] == 7 and body["usage"]["total_tokens"] == 10


def test_auto_tool_call_streamed():
    b = _builder(tools=[TOOL])
    raw = (
        b.stream_start()
        + b.stream_chunk(CALL[:10], [], None, True)
        + b.stream_chunk(CALL[10:], [], "stop", True)
    )
    raw += b.stream_end(USAGE)
    events = _events(raw)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    (call,) = events[-1]["response"]["output"]
    assert json.loads(call["arguments"]) == {"city": "Lima"}


def test_text_cut_by_the_limit_is_incomplete():
    b = _builder(max_output_tokens=3)
    body = b.response([b.choice(0, "abc", [], "length")], USAGE)
    Response.model_validate(body)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == "abc"
    events = _events(b.stream_start() + b.stream_chunk("abc", [], "length", True) + b.stream_end(USAGE))
    assert events[-1]["type"] == "response.incomplete"


def test_an_empty_answer_is_still_a_message_and_failures_are_events():
    from disagg.worker.router.errors import APIError

    b = _builder()
    events = _events(b.stream_start() + b.stream_chunk("", [], "stop", True) + b.stream_end(USAGE))
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""
    b = _builder()
    raw = (
        b.stream_start()
        + b.stream_chunk("a", [], None, True)
        + b.stream_error(APIError(503, "gone", code="x"))
    )
    events = _events(raw)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "x"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "gone"}


def test_a_forced_call_cut_by_the_limit_is_an_incomplete_function_call():
    b = _builder(tools=[{"type": "function", "name": "add"}], tool_choice="required")
    body = b.response([b.choice(0, '[{"name": "add", "parameters": {"a": 1', [], "length")], USAGE)
    assert body["status"] == "incomplete"
    (item,) = body["output"]
    assert (
        item["type"] == "function_call" and item["status"] == "incomplete" and item["arguments"] == '{"a": 1'
    )
    b = _builder(tools=[{"type": "function", "name": "add"}], tool_choice="required")
    text = '[{"name": "add", "parameters": {"a": 1'
    events = _events(b.stream_start() + b.stream_chunk(text, [], "length", True) + b.stream_end(USAGE))
    assert events[-1]["type"] == "response.incomplete"
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"]["type"] for e in done] == ["function_call"] and done[0]["item"][
        "status"
    ] == "incomplete"
