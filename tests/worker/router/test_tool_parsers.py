"""Tool-call parsers and the tool response logic (pure: no server)."""

from __future__ import annotations

import json

import pytest

from disagg.worker.router.errors import APIError
from disagg.worker.router.tool_parsers import PARSERS, ParsedCall
from disagg.worker.router.tools import ToolCalls, ToolSpec

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "add"}}]  # fmt: skip


def test_llama3_json():
    p = PARSERS["llama3_json"]
    assert p.parse('{"name": "add", "parameters": {"a": 1}}') == (None, [ParsedCall("add", '{"a": 1}')])
    content, calls = p.parse(
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": "é"}}'
    )
    assert content is None and calls == [ParsedCall("a", "{}"), ParsedCall("b", '{"x": "é"}')]
    assert p.parse("It is sunny.") == ("It is sunny.", [])
    assert p.parse('{"name": "add", "parameters": {"a": ') == ('{"name": "add", "parameters": {"a": ', [])
    assert p.stream_split("  ") == (0, False) and p.stream_split("<|pyth") == (0, False)
    assert p.stream_split(' {"na') == (0, True) and p.stream_split("Hello") == (5, False)


def test_hermes():
    p = PARSERS["hermes"]
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert p.parse(text) == ("Let me check.", [ParsedCall("get_weather", '{"city": "Oslo"}')])
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c.name for c in p.parse(two)[1]] == ["a", "b"]
    assert p.parse("<tool_call>not json</tool_call>")[1] == []
    assert p.stream_split("Sure <tool_") == (5, False)
    assert p.stream_split("Sure <tool_call>{") == (5, True) and p.stream_split("plain") == (5, False)


def test_required_named_and_auto_responses():
    required = ToolCalls(ToolSpec(TOOLS, "required"), None)
    msg, finish = required.message('[{"name": "add", "parameters": {"a": 2}}]', "stop")
    assert finish == "tool_calls" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
    assert msg["tool_calls"][0]["id"].startswith("call_") and msg["refusal"] is None
    named = ToolCalls(ToolSpec(TOOLS, "named", named="get_weather"), None)
    msg, finish = named.message('{"city": "Oslo"}', "stop")
    assert finish == "stop" and msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    legacy = ToolCalls(ToolSpec(TOOLS, "named", named="add", legacy=True), None)
    msg, finish = legacy.message("{}", "stop")
    assert finish == "function_call" and msg["function_call"] == {"name": "add", "arguments": "{}"}
    with pytest.raises(APIError) as e:
        ToolCalls(ToolSpec(TOOLS, "auto"), None)
    assert (
        e.value.status == 400 and e.value.param == "tool_choice" and "--tool-call-parser" in e.value.message
    )


@pytest.mark.parametrize(
    "mode, text, calls",
    [
        ("named", '{"city": "Os', [("get_weather", '{"city": "Os')]),
        ("named", "", [("get_weather", "")]),
        ("required", '[{"name": "add", "param', [("add", "")]),
        ("required", '[{"name": "add", "parameters": {"a": 1', [("add", '{"a": 1')]),
        ("required", '[{"name": "add", "parameters": {"a": 1}}, {"name": "get_weather", "parameters": {"ci',
         [("add", '{"a": 1}'), ("get_weather", '{"ci')]),
        ("required", '[{"parameters": {"a": 1}, "name": "add"', [("add", '{"a": 1}')]),
        ("required", '[{"na', []),  # cut before any name: no call to report, and still no content
    ],
)  # fmt: skip
def test_a_forced_call_cut_by_the_limit_is_a_partial_tool_call(mode, text, calls):
    """As OpenAI answers: finish_reason length, the call so far in tool_calls, never as content."""
    spec = ToolSpec(TOOLS, mode, named="get_weather" if mode == "named" else None)
    msg, finish = ToolCalls(spec, None).message(text, "length")
    assert finish == "length" and msg["content"] is None, msg
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    assert got == calls
    streamed = ToolCalls(spec, None)
    content, fields, finish = streamed.stream(0, text, None)
    assert content == "" and fields == {} and finish is None
    content, fields, finish = streamed.stream(0, "", "length")
    assert content == "" and finish == "length"
    assert [
        (c["function"]["name"], c["function"]["arguments"]) for c in fields.get("tool_calls", [])
    ] == calls


def test_streamed_auto_holds_calls_and_sends_text():
    tc = ToolCalls(ToolSpec(TOOLS, "auto"), "hermes")
    sent = ""
    for piece in ["Checking", " now <tool", '_call>{"name": "add", ', '"arguments": {"a": 1}}</tool_call>']:
        text, fields, finish = tc.stream(0, piece, None)
        sent += text
        assert not fields and finish is None
    text, fields, finish = tc.stream(0, "", "stop")
    assert sent + text == "Checking now " and finish == "tool_calls"
    (call,) = fields["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "add", "arguments": '{"a": 1}'}
    plain = ToolCalls(ToolSpec(TOOLS, "auto"), "llama3_json")
    assert plain.stream(1, "Hello", None) == ("Hello", {}, None)
    assert plain.stream(1, " there", "length") == (" there", {}, "length")


def test_required_schema_limits_parallel_calls():
    one = json.loads(ToolSpec(TOOLS, "required", parallel=False).structured_output().json)
    many = json.loads(ToolSpec(TOOLS, "required").structured_output().json)
    assert one["maxItems"] == 1 and "maxItems" not in many and many["minItems"] == 1
    names = [c["properties"]["name"]["enum"] for c in many["items"]["anyOf"]]
    assert names == [["get_weather"], ["add"]]
