"""OpenAI's request fields through the disaggregated path with the `openai` SDK: each is supported
or refused with a 400 naming it; the response shapes OpenAI's schema defines (refusal, logprobs)."""

from __future__ import annotations

import time

import openai
import pytest

from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.router.protocol import IGNORED_FIELDS

pytestmark = pytest.mark.timeout(300)

CHAT = [{"role": "user", "content": "Tell me about the lighthouse keeper and the storm."}]


@pytest.fixture(autouse=True)
def released(api_cluster, redis_server):
    yield
    api_cluster.assert_released(redis_server.url)


def test_developer_role_is_rendered_as_system(api_cluster, client, reference_llm):
    messages = [{"role": "developer", "content": "Answer briefly."}, *CHAT]
    as_system = [{"role": "system", "content": "Answer briefly."}, *CHAT]
    want = reference_llm.chat(as_system, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    resp = client.chat.completions.create(
        model=api_cluster.model_name, messages=messages, max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert resp.choices[0].message.content == want.outputs[0].text
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)


def test_chat_message_and_logprobs_carry_refusal_null(api_cluster, client):
    raw = client.chat.completions.with_raw_response.create(
        model=api_cluster.model_name, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2
    )
    body = raw.http_response.json()
    choice = body["choices"][0]
    assert "refusal" in choice["message"] and choice["message"]["refusal"] is None
    assert "refusal" in choice["logprobs"] and choice["logprobs"]["refusal"] is None
    assert len(choice["logprobs"]["content"]) == 3
    assert all(len(t["top_logprobs"]) == 2 for t in choice["logprobs"]["content"])


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_0_list_the_sampled_token(api_cluster, client, stream):
    resp = client.completions.create(
        model=api_cluster.model_name, prompt="The river remembers", max_tokens=4, logprobs=0, temperature=0.8,
        seed=3, stream=stream, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(resp) if stream else [resp]
    tokens, values, tops = [], [], []
    for c in chunks:
        for choice in c.choices:
            if choice.logprobs:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
                tops += choice.logprobs.top_logprobs
    assert len(tokens) == 4
    for tok, value, top in zip(tokens, values, tops, strict=True):
        assert top == {tok: pytest.approx(value)}


def test_completion_top_logprobs_include_the_sampled_token(api_cluster, client):
    resp = client.completions.create(
        model=api_cluster.model_name, prompt="The river remembers", max_tokens=6, logprobs=1, temperature=2.0,
        seed=5, extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = resp.choices[0].logprobs
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert tok in top and top[tok] == pytest.approx(value) and 1 <= len(top) <= 2


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(api_cluster, client, reference_llm, stream):
    prompt = "The old lighthouse keeper"
    free = reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    text = free.outputs[0].text
    stop = text[4:7]
    assert stop.strip(), text  # the tiny model's greedy text has a stop string to find
    for include in (False, True):
        resp = client.completions.create(
            model=api_cluster.model_name, prompt=prompt, max_tokens=12, temperature=0, stop=[stop], stream=stream,
            extra_body={"ignore_eos": True, "include_stop_str_in_output": include},
        )  # fmt: skip
        got = "".join(c.choices[0].text for c in resp if c.choices) if stream else resp.choices[0].text
        cut = text.index(stop)
        assert got == (text[: cut + len(stop)] if include else text[:cut])


def test_models_created_is_a_real_time(api_cluster, client):
    (card,) = client.models.list().data
    assert card.id == api_cluster.model_name
    assert time.time() - 3600 < card.created <= time.time()


@pytest.mark.parametrize(
    "field, value",
    [("reasoning_effort", "low"), ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
     ("prediction", {"type": "content", "content": "x"}), ("verbosity", "low"), ("web_search_options", {}),
     ("store", True), ("logit_bias", {"5": 10})],
)  # fmt: skip
def test_unsupported_chat_fields_are_refused_by_name(api_cluster, client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=api_cluster.model_name, messages=CHAT, max_tokens=2, extra_body={field: value}
        )
    assert e.value.status_code == 400
    assert e.value.body["param"] == field and field in e.value.body["message"]


def test_ignored_fields_are_accepted(api_cluster, client):
    resp = client.chat.completions.create(
        model=api_cluster.model_name, messages=[{"role": "user", "content": "hi", "name": "ann"}], max_tokens=2,
        user="u-1", safety_identifier="s-1", metadata={"k": "v"}, store=False, service_tier="auto",
        prompt_cache_key="conversation-7",
    )  # fmt: skip
    assert resp.choices[0].finish_reason in ("stop", "length")
    named = {f.split("[")[0].split(".")[0] for f in IGNORED_FIELDS}
    assert named == {
        "user",
        "safety_identifier",
        "messages",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
    }
