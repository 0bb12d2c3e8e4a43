"""Tool calling through the disaggregated path with the `openai` SDK: tools rendered by the chat
template, forced calls (required, named) constrained to their schemas, `auto` parsed by the
router's llama3_json parser, streamed `tool_calls` deltas, the legacy functions."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from disagg.worker.engine.sampling_params import SamplingParams

from .tool_schemas import WEATHER

pytestmark = pytest.mark.timeout(300)

ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Oslo this week?"}]


@pytest.fixture(autouse=True)
def released(api_cluster, redis_server):
    yield
    api_cluster.assert_released(redis_server.url)


def _chat(client, api_cluster, max_tokens=60, **kw):
    return client.chat.completions.create(
        model=api_cluster.model_name, messages=ASK, max_tokens=max_tokens, **kw
    )


def test_tools_are_rendered_by_the_chat_template(api_cluster, client, reference_llm):
    tok = reference_llm.get_tokenizer()
    with_tools = tok.apply_chat_template(ASK, add_generation_prompt=True, tools=TOOLS)
    plain = client.chat.completions.create(model=api_cluster.model_name, messages=ASK, max_tokens=1)
    resp = _chat(client, api_cluster, tools=TOOLS, tool_choice="none", temperature=0)
    assert resp.usage.prompt_tokens == len(tok.encode(with_tools, add_special_tokens=False))
    assert resp.usage.prompt_tokens > plain.usage.prompt_tokens
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].finish_reason in ("stop", "length")
    want = reference_llm.generate(
        [tok.encode(with_tools, add_special_tokens=False)], SamplingParams(temperature=0, max_tokens=60)
    )[0]
    assert resp.choices[0].message.content == want.outputs[0].text


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_match_their_schemas(api_cluster, client, parallel):
    resp = _chat(
        client,
        api_cluster,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=1.0,
        seed=4,
        n=6,
        max_tokens=250,
    )  # an array of calls: room for several
    ended = [c.finish_reason for c in resp.choices]
    # a random model may go on adding calls until max_tokens cuts it: that choice ends with
    # `length`, as OpenAI reports a cut call, and its last call may be partial
    assert set(ended) <= {"tool_calls", "length"} and "tool_calls" in ended, ended
    for choice in resp.choices:
        assert choice.message.content is None
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
        for call in complete:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_streams_tool_call_deltas(api_cluster, client):
    choice = {"type": "function", "function": {"name": "add"}}
    stream = _chat(client, api_cluster, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=1, stream=True)
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert content == "" and finish == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "add"
    jsonschema.validate(json.loads(calls[0]["arguments"]), ADD)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_llama3_json_calls(api_cluster, client, stream):
    """The tiny model writes no calls of its own accord: a guided choice makes it write exactly a
    Llama 3 call, which the router's parser must turn into tool_calls."""
    written = '{"name": "get_weather", "parameters": {"city": "Lima", "days": 3}}'
    resp = _chat(client, api_cluster, tools=TOOLS, tool_choice="auto", temperature=0, stream=stream,
                 extra_body={"guided_choice": [written]})  # fmt: skip
    if not stream:
        (choice,) = resp.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Lima", "days": 3}
        return
    content, names, args, finish = "", "", "", None
    for chunk in resp:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                names += d.function.name or ""
                args += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert content == "" and finish == "tool_calls" and names == "get_weather"
    assert json.loads(args) == {"city": "Lima", "days": 3}


def test_auto_without_a_call_is_text(api_cluster, client):
    resp = _chat(
        client, api_cluster, tools=TOOLS, temperature=0, extra_body={"guided_choice": ["It is sunny."]}
    )
    assert resp.choices[0].message.content == "It is sunny." and resp.choices[0].message.tool_calls is None
    assert resp.choices[0].finish_reason == "stop"


def test_a_conversation_with_tool_results(api_cluster, client, reference_llm):
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]  # fmt: skip
    resp = client.chat.completions.create(model=api_cluster.model_name, messages=messages, tools=TOOLS,
                                          tool_choice="none", max_tokens=2)  # fmt: skip
    tok = reference_llm.get_tokenizer()
    rendered = tok.apply_chat_template(
        [ASK[0], {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]}, messages[2]],
        add_generation_prompt=True, tools=TOOLS,
    )  # fmt: skip
    assert '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}' in rendered
    assert resp.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


def test_legacy_functions(api_cluster, client):
    functions = [t["function"] for t in TOOLS]
    resp = client.chat.completions.create(model=api_cluster.model_name, messages=ASK, max_tokens=60,
                                          functions=functions, function_call={"name": "get_weather"})  # fmt: skip
    choice = resp.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.function_call.name == "get_weather"
    jsonschema.validate(json.loads(choice.message.function_call.arguments), WEATHER)


def test_tool_schemas_count_toward_the_prompt_size_limit(api_cluster, client):
    """Tool definitions are rendered into the prompt, so a huge one is refused before tokenizing."""
    huge = [
        {"type": "function", "function": {"name": "f", "description": "x" * (1 << 20), "parameters": WEATHER}}
    ]
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, api_cluster, tools=huge, tool_choice="none")
    assert info.value.body["param"] == "messages" and info.value.body["code"] == "prompt_too_large"
