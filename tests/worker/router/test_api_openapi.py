"""`/openapi.json` against the running router: generated from the pydantic models, every served
body valid against its response model, and schemathesis finding no 5xx and no response that
breaks the document, and every negative case (a body the document forbids) refused with a 4xx
(bounded examples per endpoint, through the disaggregated path)."""

from __future__ import annotations

import multiprocessing

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation import GenerationMode

from disagg.worker.router import response_models as rm
from disagg.worker.router.protocol import ChatCompletionRequest

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def released(api_cluster, redis_server):
    yield
    api_cluster.assert_released(redis_server.url)


def test_the_document_is_the_models(api_cluster):
    doc = httpx.get(f"{api_cluster.url}/openapi.json").json()
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models",
                                 "/v1/models/{model_id}"}  # fmt: skip
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert set(chat["properties"]) == {f.alias or n for n, f in ChatCompletionRequest.model_fields.items()}
    assert chat["properties"]["model"] == {"type": "string", "const": api_cluster.model_name}
    post = doc["paths"]["/v1/responses"]["post"]
    assert post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ResponseObject"
    )


def test_served_bodies_match_their_models(api_cluster):
    """The builders' output against the response models (forbidding extra fields), with the
    optional parts present: logprobs, echo, tool calls."""
    url, model = api_cluster.url, api_cluster.model_name
    params = {
        "type": "object",
        "properties": {"a": {"enum": [1, 2]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    with httpx.Client(base_url=url, timeout=120) as c:
        rm.ModelList.model_validate(c.get("/v1/models").json())
        rm.Completion.model_validate(c.post("/v1/completions", json={
            "model": model, "prompt": "Hello there", "max_tokens": 3, "logprobs": 2, "echo": True}).json())  # fmt: skip
        rm.ChatCompletion.model_validate(c.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 2}).json())  # fmt: skip
        called = rm.ChatCompletion.model_validate(c.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "tools": [tool],
            "tool_choice": "required", "parallel_tool_calls": False}).json())  # fmt: skip
        assert called.choices[0].message.tool_calls
        rm.ResponseObject.model_validate(c.post("/v1/responses", json={
            "model": model, "input": "Hi", "max_output_tokens": 3}).json())  # fmt: skip
        rm.ErrorResponse.model_validate(c.post("/v1/responses", json={"model": model, "input": ""}).json())


def _conforms(url: str) -> None:
    """Each operation's generated cases (schemathesis strategies driven by hypothesis directly: its
    pytest plugin does not load under this pytest)."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert sorted(op.label for op in operations) == [
        "GET /v1/models",
        "GET /v1/models/{model_id}",
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /v1/responses",
    ]
    # positive cases conform; negative ones (a body the document forbids) are refused with a 4xx
    negative_checks = [not_a_server_error, content_type_conformance, negative_data_rejection]
    for op in operations:
        _run_cases(op, GenerationMode.POSITIVE, checks)
        if op.method.upper() == "POST":
            _run_cases(op, GenerationMode.NEGATIVE, negative_checks)


def _run_cases(op, mode: GenerationMode, checks: list) -> None:
    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)  # fmt: skip
    def conforms(case):
        case.call_and_validate(checks=checks, timeout=60)

    try:
        conforms()
    except Exception as e:  # schemathesis' failures do not pickle: their report does
        raise AssertionError(f"{op.label} ({mode.value}): {e}") from None


def test_schemathesis_no_5xx_and_conforming_responses(api_cluster):
    # a fresh interpreter: a native library this one loaded (compiled with fast-math) may have set
    # the CPU's flush-to-zero mode, under which hypothesis refuses to generate floats
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pool.apply(_conforms, (api_cluster.url,))
