"""Structured output through the disaggregated path with the `openai` SDK: the prefill worker
constrains the first token, the decode worker the rest; 100 sampled `json_schema` outputs at
temperature 1 all validate; vLLM's guided_* extras; invalid grammars are 400s naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "population": {"type": "integer", "minimum": 0, "maximum": 9999},
        "coastal": {"type": "boolean"},
        "climate": {"enum": ["dry", "wet", "cold"]},
    },
    "required": ["city", "population", "coastal", "climate"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.fixture(autouse=True)
def released(api_cluster, redis_server):
    yield
    api_cluster.assert_released(redis_server.url)


def test_100_sampled_json_schema_outputs_validate(api_cluster, client):
    def batch(seed: int):
        # a prompt no cache holds yet, so the decode worker has it prefilled remotely
        ask = [{"role": "user", "content": f"Describe city number {seed} of the hundred as JSON."}]
        return client.chat.completions.with_raw_response.create(
            model=api_cluster.model_name, messages=ask, response_format=FORMAT, n=25, temperature=1.0,
            seed=seed, max_tokens=60,
        )  # fmt: skip

    with ThreadPoolExecutor(4) as pool:
        raws = list(pool.map(batch, range(4)))
    texts = []
    for raw in raws:
        assert "X-Disagg-Prefill-Worker" in raw.headers  # the first token was sampled on the prefill worker
        for choice in raw.parse().choices:
            assert choice.finish_reason == "stop", choice.message.content
            texts.append(choice.message.content)
    assert len(texts) == 100
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 10  # sampled at temperature 1, not one string


def test_streamed_json_schema_and_json_object(api_cluster, client):
    stream = client.chat.completions.create(
        model=api_cluster.model_name, messages=ASK, response_format=FORMAT, n=3, temperature=1.0, seed=9,
        max_tokens=60, stream=True,
    )  # fmt: skip
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    resp = client.chat.completions.create(
        model=api_cluster.model_name, messages=ASK, response_format={"type": "json_object"}, temperature=0,
        max_tokens=200,
    )  # fmt: skip
    text = resp.choices[0].message.content
    assert text.startswith("{")
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_guided_extras_on_completions(api_cluster, client):
    kw = dict(
        model=api_cluster.model_name, prompt="The answer is", max_tokens=20, temperature=1.0, n=4, seed=2
    )
    out = client.completions.create(**kw, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", c.text) for c in out.choices), [c.text for c in out.choices]
    out = client.completions.create(**kw, extra_body={"guided_choice": ["left", "right", "straight on"]})
    assert all(c.text in ("left", "right", "straight on") for c in out.choices)
    out = client.completions.create(
        **{**kw, "max_tokens": 60}, extra_body={"guided_json": SCHEMA}, stream=True
    )
    texts = [""] * 4
    for chunk in out:
        for c in chunk.choices:
            texts[c.index] += c.text
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    lark = 'start: "<" word ">"\nword: /[a-z]{1,6}/'
    out = client.completions.create(**kw, extra_body={"guided_grammar": lark})
    assert all(re.fullmatch(r"<[a-z]{1,6}>", c.text) for c in out.choices), [c.text for c in out.choices]


@pytest.mark.parametrize(
    "extra, param",
    [({"response_format": {"type": "xml"}}, "response_format.type"),
     ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
      "response_format.json_schema.schema"),
     ({"guided_regex": "a(b"}, "guided_regex"),
     ({"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_choice")],
)  # fmt: skip
def test_invalid_structured_output_is_a_400_naming_the_field(api_cluster, client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=api_cluster.model_name, messages=ASK, max_tokens=5, extra_body=extra
        )
    assert e.value.body["param"] == param
