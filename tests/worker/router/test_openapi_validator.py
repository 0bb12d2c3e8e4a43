"""`/openapi.json` accepts what the validator accepts: each body below is checked against the
generated document (jsonschema) and by the router's own validation, and both must agree."""

from __future__ import annotations

import jsonschema
import pytest

from disagg.worker.router.errors import APIError
from disagg.worker.router.openapi import openapi_spec
from disagg.worker.router.responses_request import parse_responses
from disagg.worker.router.validation import parse_chat, parse_completion

DOC = openapi_spec("m")
PARSERS = {"CompletionRequest": parse_completion, "ChatCompletionRequest": parse_chat,
           "ResponsesRequest": parse_responses}  # fmt: skip


def _schema_accepts(model: str, body: dict) -> bool:
    schema = {**DOC, "$ref": f"#/components/schemas/{model}"}
    return jsonschema.Draft202012Validator(schema).is_valid(body)


def _validator_accepts(model: str, body: dict) -> bool:
    try:
        PARSERS[model](body)
    except APIError:
        return False
    return True


def _chat(**message):
    return {"model": "m", "messages": [message]}


CASES = [
    ("ChatCompletionRequest", _chat(role="user", content="x")),
    ("ChatCompletionRequest", _chat(role="", content="x")),
    ("ChatCompletionRequest", _chat(role="robot", content="x")),
    ("ChatCompletionRequest", _chat(role="developer", content="x")),
    ("ChatCompletionRequest", {**_chat(role="user", content="x"), "top_k": 2**31}),
    ("ChatCompletionRequest", {**_chat(role="user", content="x"), "stream": True,
                               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("ResponsesRequest", {"model": "m", "input": "hi"}),
    ("ResponsesRequest", {"model": "m", "input": ""}),
    ("ResponsesRequest", {"model": "m", "input": []}),
    ("ResponsesRequest", {"model": "m", "input": [{"role": "user", "content": "x"}]}),
    ("ResponsesRequest", {"model": "m", "input": "hi", "max_output_tokens": 2**31}),
    *[("CompletionRequest", {"model": "m", "prompt": p}) for p in (
        "x", "", [1, 2], [], [1, -2], [1, 2**31], ["a", "b"], ["a", ""], ["a", 2], [[1], [2, 3]], [[1], []],
        [[1], "a"], {"a": 1}, 5, None, True,
    )],
    ("CompletionRequest", {"model": "m"}),
]  # fmt: skip


@pytest.mark.parametrize("model, body", CASES)
def test_the_document_and_the_validator_agree(model, body):
    assert _schema_accepts(model, body) == _validator_accepts(model, body), body


def test_every_route_is_documented():
    assert set(DOC["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models",
                                 "/v1/models/{model_id}"}  # fmt: skip
