"""End to end with real processes: router -> decode worker -> prefill worker, KV over real NIXL,
registry and prefix index in a real Redis. Outputs must equal the colocated engine's."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from disagg.proto import worker_pb2 as pb
from disagg.worker.engine.sampling_params import SamplingParams

from ..cluster import Cluster, complete, greedy_body, threshold_placement

pytestmark = pytest.mark.timeout(300)

THRESHOLD = 8  # prompts of 8+ uncached tokens are prefilled on a prefill worker
LENGTHS = [3, 9, 15, 16, 17, 31, 32, 33, 47, 70]  # ragged, around block boundaries (block size 16)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, redis_server):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("e2e"),
        redis_url=redis_server.url,
        prefill=1,
        decode=1,
        worker_args=threshold_placement(THRESHOLD),
        deployment="e2e",
    )
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def accounting_back_to_zero(cluster, redis_server):
    yield
    cluster.assert_released(redis_server.url)


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in LENGTHS]


def test_greedy_ragged_batch_matches_colocated_engine(cluster, reference_llm):
    prompts = _prompts(reference_llm.engine.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference_llm.generate(prompts, params)]
    remote_before = cluster.metric("decode-0", "disagg_disaggregation_decisions_total")
    landing_before = cluster.metric("decode-0", "disagg_remote_prefill_commits_total", on="landing")
    sends_before = cluster.metric("prefill-0", "disagg_kv_transfer_seconds_count")
    bodies = [
        {"model": cluster.model_name, "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        for p in prompts
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:  # concurrently: the workers batch them
        responses = list(pool.map(lambda b: complete(cluster.url, b), bodies))
    for n, r, want in zip(LENGTHS, responses, expected, strict=True):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == want, f"prompt of {n} tokens"
        assert body["usage"]["completion_tokens"] == 12 and body["usage"]["prompt_tokens"] == n
        remote = n >= THRESHOLD
        assert ("X-Disagg-Prefill-Worker" in r.headers) == remote, (n, dict(r.headers))
    assert cluster.metric("decode-0", "disagg_disaggregation_decisions_total") == remote_before + len(prompts)
    assert cluster.metric("prefill-0", "disagg_kv_transfer_bytes_total") > 0
    n_remote = sum(n >= THRESHOLD for n in LENGTHS)
    # each first token came in its transfer's FINAL notice: decoding began as the KV landed
    landed = cluster.metric("decode-0", "disagg_remote_prefill_commits_total", on="landing")
    assert landed == landing_before + n_remote
    # the KV left layer by layer, each layer as soon as the prefill had computed it
    layers = reference_llm.engine.config.num_hidden_layers
    assert cluster.metric("prefill-0", "disagg_kv_transfer_seconds_count") - sends_before == n_remote * layers


def test_second_request_with_a_cached_prefix_skips_those_blocks(cluster, reference_llm):
    """D decoded the first request, so the shared prefix is in D's cache: the second request's
    prefill still runs on P, but only the blocks D lacks cross the wire."""
    rng = random.Random(4)
    vocab = reference_llm.engine.config.vocab_size
    prefix = [rng.randrange(5, vocab) for _ in range(48)]  # three full blocks
    prompts = [prefix + [rng.randrange(5, vocab) for _ in range(n)] for n in (20, 30)]  # 5 blocks each
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference_llm.generate(prompts, params)]
    sent, hits = [], []
    for prompt, want in zip(prompts, expected, strict=True):
        bytes_before = cluster.metric("prefill-0", "disagg_kv_transfer_bytes_total")
        hits_before = cluster.metric("decode-0", "disagg_prefix_cache_hits_total")
        body = greedy_body(cluster.model_name, prompt, 6)
        r = complete(cluster.url, body)
        assert r.status_code == 200, r.text
        cluster.assert_prefilled_on(r, "prefill-0")
        assert r.json()["choices"][0]["text"] == want
        cluster.wait_idle()
        sent.append(cluster.metric("prefill-0", "disagg_kv_transfer_bytes_total") - bytes_before)
        hits.append(cluster.metric("decode-0", "disagg_prefix_cache_hits_total") - hits_before)
    assert sent[0] > 0 and sent[1] * 5 == sent[0] * 2  # 5 blocks, then 2 of 5
    assert hits == [0, 3]
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48


def test_prefill_refuses_to_skip_the_block_of_the_last_prompt_token(cluster):
    req = pb.PrefillRequest(
        request_id="skip-all", prompt_token_ids=[7] * 20, decode_worker_id="decode-0",
        dst_block_ids=[0, 1], skip_leading_blocks=2, transfer_id="skip-all:0:0",
    )  # fmt: skip
    resp = cluster.stub("prefill-0").Prefill(req, timeout=10)
    assert resp.error.code == "invalid_request" and "skip_leading_blocks" in resp.error.message


def test_logprobs_and_stop_through_the_disaggregated_path(cluster, reference_llm):
    prompt = _prompts(reference_llm.engine.config.vocab_size, seed=1)[-1]
    ref = reference_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    )[0]
    commits = "disagg_remote_prefill_commits_total"
    on_answer = cluster.metric("decode-0", commits, on="answer")
    r = complete(
        cluster.url,
        {"model": cluster.model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2,
         "ignore_eos": True},
    )  # fmt: skip
    assert r.status_code == 200 and "X-Disagg-Prefill-Worker" in r.headers
    # the first token's logprobs come only in P's answer: committed from it, not on landing
    assert cluster.metric("decode-0", commits, on="answer") == on_answer + 1
    lp = r.json()["choices"][0]["logprobs"]
    want = [t.logprob for t in ref.outputs[0].logprobs]
    assert lp["token_logprobs"] == pytest.approx(want, abs=1e-4)
    assert all(len(top) == 2 for top in lp["top_logprobs"])


def test_openai_client_streams_chat_and_completion(cluster, reference_llm):
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    messages = [
        {"role": "user", "content": "Tell me about disaggregated serving of language models, briefly."}
    ]
    want = reference_llm.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    stream = client.chat.completions.create(
        model=cluster.model_name,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == want.outputs[0].text
    assert finish == "length" and usage.completion_tokens == 10
    assert usage.prompt_tokens == len(want.prompt_token_ids) >= THRESHOLD

    prompt = "The quick brown fox jumps over the lazy dog, again and again and again."
    want = reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    stream = client.completions.create(
        model=cluster.model_name, prompt=prompt, max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.outputs[0].text
    models = client.models.list()
    assert [m.id for m in models.data] == [cluster.model_name]


def test_32_concurrent_streams_all_finish(cluster):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        stream = await client.chat.completions.create(
            model=cluster.model_name,
            messages=[{"role": "user", "content": f"request {i}: " + "word " * (i * 3)}],
            max_tokens=16,
            temperature=0.7,
            seed=i,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, finish = "", None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    assert all(finish == "length" for _text, finish in results), results


def test_malformed_requests_get_4xx_and_do_not_disturb_others(cluster, reference_llm):
    prompt = _prompts(reference_llm.engine.config.vocab_size, seed=2)[-1]
    want = reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    result = {}

    def long_stream():
        body = {"model": cluster.model_name, "prompt": prompt, "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        text = ""
        with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        result["text"] = text

    t = threading.Thread(target=long_stream)
    t.start()
    url = f"{cluster.url}/v1/completions"
    bad = [
        (httpx.post(url, content=b'{"model": ', headers={"Content-Type": "application/json"}), 400, None),
        (httpx.post(url, json={"model": cluster.model_name, "prompt": "x", "max_tokens": -3}), 400, "max_tokens"),
        (httpx.post(url, json={"model": "no-such-model", "prompt": "x"}), 404, "model"),
        (httpx.post(url, json={"model": cluster.model_name, "prompt": [7] * 2040}), 400, "max_tokens"),
        (httpx.post(url, json={"model": cluster.model_name, "prompt": [7] * 2100}), 400, "prompt"),
        (httpx.post(f"{cluster.url}/v1/chat/completions", json={"model": cluster.model_name, "messages": "hi"}),
         400, "messages"),
    ]  # fmt: skip
    t.join(120)
    for r, status, param in bad:
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"]
    assert result["text"] == want.outputs[0].text


def test_client_disconnect_aborts_on_the_workers(cluster):
    body = {"model": cluster.model_name, "prompt": list(range(10, 60)), "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 3:
                break  # hang up mid-stream
    loads = cluster.wait_idle()
    assert loads["decode-0"].running == 0 and loads["decode-0"].used_blocks == 0


def test_metrics_pages_carry_the_contract_names(cluster):
    for prompt in ([11, 12, 13], list(range(20, 60))):  # one prefilled locally, one remotely
        r = complete(cluster.url, {"model": cluster.model_name, "prompt": prompt, "max_tokens": 3})
        assert r.status_code == 200, r.text
    cluster.wait_idle()
    names = [
        "disagg_time_to_first_token_seconds_count", "disagg_inter_token_latency_seconds_count",
        "disagg_e2e_request_latency_seconds_count", "disagg_queue_time_seconds_count",
        "disagg_prompt_tokens_total", "disagg_generation_tokens_total", "disagg_requests_total",
        "disagg_prefix_cache_queries_total",
    ]  # fmt: skip
    for name in names:
        assert cluster.metric("decode-0", name) > 0, name
    for gauge in ("disagg_num_requests_running", "disagg_num_requests_waiting", "disagg_kv_cache_usage_ratio",
                  "disagg_kv_blocks_used"):  # fmt: skip
        assert cluster.metric("decode-0", gauge) == 0, gauge  # idle again
    assert cluster.metric("decode-0", "disagg_kv_blocks_free") == 512
    assert cluster.metric("prefill-0", "disagg_time_to_first_token_seconds_count") > 0
    assert cluster.metric("router", "disagg_e2e_request_latency_seconds_count") > 0
    assert cluster.metric("router", "disagg_prefix_cache_queries_total") > 0
