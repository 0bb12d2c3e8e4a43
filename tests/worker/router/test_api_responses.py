"""`/v1/responses` through the disaggregated path with the `openai` SDK: the same generation as
chat completions (greedy outputs equal), instructions, max_output_tokens, the streamed event
sequence, function tools and their outputs, `text.format` json_schema, refusals by name."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from .tool_schemas import WEATHER

pytestmark = pytest.mark.timeout(300)

TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
ASK = "What is the weather in Oslo this week?"


@pytest.fixture(autouse=True)
def released(api_cluster, redis_server):
    yield
    api_cluster.assert_released(redis_server.url)


def _chat(client, api_cluster, messages, **kw):
    return client.chat.completions.create(
        model=api_cluster.model_name, messages=messages, temperature=0, **kw
    )


def test_text_with_instructions_equals_chat(api_cluster, client):
    resp = client.responses.create(model=api_cluster.model_name, instructions="Answer briefly.", input=ASK,
                                   max_output_tokens=12, temperature=0)  # fmt: skip
    chat = _chat(client, api_cluster, [{"role": "system", "content": "Answer briefly."},
                                       {"role": "user", "content": ASK}], max_tokens=12)  # fmt: skip
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == api_cluster.model_name
    assert resp.created_at > 0 and resp.instructions == "Answer briefly." and resp.max_output_tokens == 12
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens <= 12
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    finished = chat.choices[0].finish_reason
    assert (resp.status, item.status) == (("incomplete",) * 2 if finished == "length" else ("completed",) * 2)
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"


def test_message_items_and_developer_role(api_cluster, client):
    items = [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": " there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello.",
                                                              "annotations": []}]},
        {"role": "user", "content": "Bye"},
    ]  # fmt: skip
    resp = client.responses.create(
        model=api_cluster.model_name, input=items, max_output_tokens=8, temperature=0
    )
    chat = _chat(client, api_cluster, [{"role": "system", "content": "Be terse."},
                                       {"role": "user", "content": "Hi there"},
                                       {"role": "assistant", "content": "Hello."},
                                       {"role": "user", "content": "Bye"}], max_tokens=8)  # fmt: skip
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.output_text == chat.choices[0].message.content


def test_streamed_event_sequence(api_cluster, client):
    whole = client.responses.create(
        model=api_cluster.model_name, input=ASK, max_output_tokens=20, temperature=0
    )
    events = list(client.responses.create(model=api_cluster.model_name, input=ASK, max_output_tokens=20,
                                          temperature=0, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    final = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done", final,
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    done = events[-1].response
    assert done.output_text == text and done.id == events[0].response.id and done.id.startswith("resp_")
    assert events[0].response.status == "in_progress" and done.status == whole.status
    assert done.usage.output_tokens == whole.usage.output_tokens
    assert done.usage.input_tokens == whole.usage.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_tool_call(api_cluster, client, stream):
    resp = client.responses.create(model=api_cluster.model_name, input=ASK, tools=TOOLS, temperature=1.0,
                                   tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                   stream=stream)  # fmt: skip
    if stream:
        events = list(resp)
        kinds = [e.type for e in events]
        assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.function_call_arguments.delta", "response.function_call_arguments.done",
                         "response.output_item.done", "response.completed"]  # fmt: skip
        assert events[4].arguments == events[3].delta == events[5].item.arguments
        resp = events[-1].response
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.status == "completed" and resp.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_required_tool_choice(api_cluster, client):
    resp = client.responses.create(model=api_cluster.model_name, input=ASK, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, max_output_tokens=120, temperature=1.0)  # fmt: skip
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_function_call_output_is_a_tool_message(api_cluster, client):
    items = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
    ]  # fmt: skip
    resp = client.responses.create(model=api_cluster.model_name, input=items, tools=TOOLS, tool_choice="none",
                                   max_output_tokens=6, temperature=0)  # fmt: skip
    chat = _chat(client, api_cluster, [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ], tools=CHAT_TOOLS, tool_choice="none", max_tokens=6)  # fmt: skip
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.output_text == chat.choices[0].message.content


def test_text_format_json_schema(api_cluster, client):
    fmt = {"type": "json_schema", "name": "forecast", "schema": WEATHER, "strict": True}
    for _ in range(3):
        resp = client.responses.create(model=api_cluster.model_name, input=ASK, text={"format": fmt},
                                       max_output_tokens=60, temperature=1.0)  # fmt: skip
        jsonschema.validate(json.loads(resp.output_text), WEATHER)
        assert resp.text.format.type == "json_schema"


@pytest.mark.parametrize(
    "field, value, param",
    [("previous_response_id", "resp_1", "previous_response_id"), ("store", True, "store"),
     ("background", True, "background"), ("reasoning", {"effort": "low"}, "reasoning"),
     ("include", ["message.output_text.logprobs"], "include"), ("tools", [{"type": "web_search"}], "tools[0].type"),
     ("input", [{"type": "reasoning", "summary": []}], "input[0].type"), ("frequency_penalty", 1, "frequency_penalty"),
     ("text", {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}, "text.format.schema")],
)  # fmt: skip
def test_unsupported_fields_are_refused_by_name(api_cluster, client, field, value, param):
    body = {"model": api_cluster.model_name, "input": ASK, "max_output_tokens": 2, field: value}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", cast_to=object, body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_ignored_fields_are_accepted(api_cluster, client):
    resp = client.responses.create(model=api_cluster.model_name, input=ASK, max_output_tokens=2, store=False,
                                   user="u-1", metadata={"k": "v"}, truncation="disabled", service_tier="auto",
                                   prompt_cache_key="c-1", safety_identifier="s-1")  # fmt: skip
    assert resp.status in ("completed", "incomplete") and resp.metadata == {"k": "v"}
