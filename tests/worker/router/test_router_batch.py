"""Batched prompts and n > 1: validation, fan-out planning and response assembly without a server,
then end to end through real workers (router -> decode -> prefill over NIXL, real Redis)."""

from __future__ import annotations

import json
import random
import re
import warnings

import httpx
import openai
import pytest

from disagg.proto import worker_pb2 as pb
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.router.args import RouterArgs
from disagg.worker.router.errors import APIError
from disagg.worker.router.fanout import ChoiceState, derive_seed, plan_choices, total_usage
from disagg.worker.router.openai_format import Logprob, ResponseBuilder
from disagg.worker.router.protocol import INT64_MAX
from disagg.worker.router.validation import check_choice_count, parse_chat, parse_completion

from ..cluster import Cluster
from .router_client import router_client as _client

CHAT = [{"role": "user", "content": "hi"}]


def _err(fn, body) -> APIError:
    with pytest.raises(APIError) as info:
        fn(body)
    assert info.value.status == 400
    return info.value


# ---- validation ---------------------------------------------------------------------------------
def test_batched_prompts_and_n_are_parsed():
    spec = parse_completion({"model": "m", "prompt": ["a b", "c"], "n": 3})
    assert spec.prompts == ["a b", "c"] and spec.n == 3 and spec.num_choices == 6
    spec = parse_completion({"model": "m", "prompt": [[1, 2], [3]], "n": 2, "best_of": 2})
    assert spec.prompts == [[1, 2], [3]] and spec.num_prompts == 2 and spec.num_choices == 4
    assert parse_completion({"model": "m", "prompt": [5, 6]}).prompts == [[5, 6]]
    chat = parse_chat({"model": "m", "messages": CHAT, "n": 4, "temperature": 0})
    assert chat.n == 4 and chat.num_prompts == 1 and chat.num_choices == 4


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": ["a", 3]}, "prompt", "mix"),
        ({"prompt": [[1], "a"]}, "prompt", "mix"),
        ({"prompt": [[1, 2], [3, "x"]]}, "prompt", "prompt[1]"),
        ({"prompt": [[1], []]}, "prompt", "prompt[1]"),
        ({"prompt": [[1], [-4]]}, "prompt", "non-negative"),
        ({"prompt": ["a", ""]}, "prompt", "prompt[1]"),
        ({"prompt": "x", "n": 0}, "n", ">= 1"),
        ({"prompt": "x", "n": 2, "best_of": 1}, "best_of", "greater than or equal to n"),
        ({"prompt": "x", "n": 2, "best_of": 4}, "best_of", "not supported"),
        ({"prompt": "x", "best_of": 2}, "best_of", "not supported"),
        ({"prompt": "x", "seed": 2**63}, "seed", "<= 9223372036854775807"),
    ],
)
def test_batch_refusals_name_the_field(body, param, words):
    e = _err(parse_completion, {"model": "m", **body})
    assert e.param == param and words in e.message, e.message


def test_choice_cap_names_n_or_prompt():
    check_choice_count(parse_completion({"model": "m", "prompt": ["a"] * 4, "n": 16}), 64)
    e = _err(lambda b: check_choice_count(parse_completion(b), 64), {"model": "m", "prompt": "x", "n": 65})
    assert e.param == "n" and "65" in e.message
    e = _err(
        lambda b: check_choice_count(parse_completion(b), 64), {"model": "m", "prompt": ["a"] * 8, "n": 9}
    )
    assert e.param == "n" and "72" in e.message
    e = _err(lambda b: check_choice_count(parse_completion(b), 4), {"model": "m", "prompt": ["a"] * 5})
    assert e.param == "prompt"
    e = _err(lambda b: check_choice_count(parse_chat(b), 4), {"model": "m", "messages": CHAT, "n": 5})
    assert e.param == "n"


# ---- fan-out planning and assembly ---------------------------------------------------------------
def test_choice_indices_follow_openai_and_seeds_are_derived():
    plans = plan_choices(num_prompts=2, n=3, seed=10)
    assert [(p.index, p.prompt_index, p.sample_index) for p in plans] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1), (5, 1, 2),
    ]  # fmt: skip
    assert [p.seed for p in plans] == [10, 11, 12, 10, 11, 12]
    assert [p.seed for p in plan_choices(1, 3, None)] == [None, None, None]
    assert derive_seed(INT64_MAX, 1) == -(2**63)  # wraps inside the wire's int64
    assert derive_seed(7, 0) == 7


def _msg(text: str, ids: list[int], finish: str = "", usage: tuple[int, int, int] | None = None, prefill=""):
    m = pb.GenerateResponse(token_ids=ids, text=text, finish_reason=finish)
    m.logprobs.extend(pb.TokenLogprob(token_id=t, logprob=-0.5) for t in ids)
    if usage:
        m.usage.CopyFrom(pb.Usage(prompt_tokens=usage[0], completion_tokens=usage[1], cached_tokens=usage[2]))
    if prefill:
        m.served_by.CopyFrom(pb.ServedBy(decode_worker="d", prefill_worker=prefill))
    return m


def test_choice_state_and_usage_count_each_prompt_once():
    plans = plan_choices(num_prompts=2, n=2, seed=None)
    states = [ChoiceState(p) for p in plans]
    for s in states:
        p = s.plan.prompt_index
        assert s.add(_msg("a", [1], prefill="p0" if p == 0 else ""), now=1.0).logprobs[0].token_id == 1
        s.add(_msg("bc", [2, 3], finish="length", usage=(10 + p, 3, 16 * p)), now=2.0)
    assert states[0].prefill_worker == "p0" and states[3].prefill_worker == ""
    assert "".join(states[1].text) == "abc" and states[1].finish_reason == "length"
    assert states[2].first_token_at == 1.0 and states[2].last_at == 2.0 and states[2].num_tokens == 3
    assert states[2].itl == [0.5, 0.5]  # two tokens arrived together, 1 s after the first
    usage = total_usage(states, prompt_lengths=[10, 11])
    assert usage["prompt_tokens"] == 21 and usage["completion_tokens"] == 12 and usage["total_tokens"] == 33
    assert usage["prompt_tokens_details"] == {"cached_tokens": 16}
    # a stream that ended without usage: the prompt's own length and the tokens seen
    bare = [ChoiceState(p) for p in plan_choices(1, 2, None)]
    bare[0].add(_msg("x", [4, 5]), now=1.0)
    assert total_usage(bare, [7]) == {
        "prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0},
    }  # fmt: skip


def test_builder_keeps_per_choice_stream_state_and_orders_full_choices():
    chat = ResponseBuilder("chat", "m", lambda t: f"<{t}>", want_logprobs=False)
    first1 = chat.chunk("x", [], None, include_usage=True, index=1)
    first0 = chat.chunk("y", [], None, include_usage=True, index=0)
    again1 = chat.chunk("z", [], "stop", include_usage=True, index=1)
    assert first1["choices"][0]["delta"] == {"role": "assistant", "content": "x"}
    assert (
        first0["choices"][0]["delta"]["role"] == "assistant" and "role" not in again1["choices"][0]["delta"]
    )
    assert [c["choices"][0]["index"] for c in (first1, first0, again1)] == [1, 0, 1]
    assert first1["id"] == again1["id"] and first1["usage"] is None
    comp = ResponseBuilder("completion", "m", lambda t: f"<{t}>", want_logprobs=True)
    comp.chunk("ab", [Logprob(1, -1.0)], None, False, index=0)
    other = comp.chunk("cd", [Logprob(2, -1.0)], None, False, index=1)
    later = comp.chunk("ef", [Logprob(3, -1.0)], None, False, index=0)
    assert other["choices"][0]["logprobs"]["text_offset"] == [0]  # each choice has its own offsets
    assert later["choices"][0]["logprobs"]["text_offset"] == [2]
    full = comp.response([comp.choice(i, t, [], "stop") for i, t in ((2, "c"), (0, "a"), (1, "b"))], {"x": 1})
    assert [c["index"] for c in full["choices"]] == [0, 1, 2] and [c["text"] for c in full["choices"]] == [
        "a", "b", "c",
    ]  # fmt: skip
    assert full["object"] == "text_completion" and full["usage"] == {"x": 1}


# ---- the HTTP layer in-process (no workers) -----------------------------------------------------


async def test_admission_counts_every_generation(tokenizer):
    # a queue smaller than max_choices (which the flags refuse): one request's generations fill it
    args = RouterArgs(max_model_len=64, max_queue=8, max_choices=8)
    args.max_queue = 3
    client = await _client(tokenizer, args=args)
    try:
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"], "n": 2})
        assert r.status == 429 and r.headers["Retry-After"] == "1"  # 4 generations > a queue of 3
        r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "n": 3})
        assert r.status == 503  # admitted; no worker is ready
        r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "n": 9})
        assert r.status == 400 and (await r.json())["error"]["param"] == "n"
        # every prompt of a batch is checked against the context before anything is routed
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": [[5] * 10, [5] * 60]})
        err = (await r.json())["error"]
        assert r.status == 400 and err["code"] == "context_length_exceeded" and "prompt[1]" in err["message"]
    finally:
        await client.close()


# ---- end to end ----------------------------------------------------------------------------------
WORKER_CONTEXT = 256  # the workers' context; the router believes the model's 2048 (see the failure test)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, redis_server):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("batch"),
        redis_url=redis_server.url,
        prefill=1,
        decode=1,
        worker_args=(
            "--prefill-placement",
            "threshold",
            "--disagg-threshold",
            "8",
            "--max-model-len",
            str(WORKER_CONTEXT),
        ),
        deployment="batch",
    )
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture
def idle_after(cluster, redis_server):
    yield
    cluster.assert_released(redis_server.url)


def _post(cluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{cluster.url}/v1/{path}", json={"model": cluster.model_name, **body}, timeout=120)


def _finished(cluster, name: str, finish_reason: str) -> float:
    """A process's count of generations that ended with `finish_reason` (its /metrics page)."""
    return cluster.metric(name, "disagg_requests_total", finish_reason=finish_reason)


# Where decode-0 prefilled prompts (`disagg_disaggregation_decisions_total`): remotely by the
# threshold, here because short, or here after all, though placed remotely (and why).
FALLBACKS = ("remote_failed", "no_free_blocks")


def _placements(cluster) -> dict[str, float]:
    count = lambda decision, reason: cluster.metric(  # noqa: E731
        "decode-0", "disagg_disaggregation_decisions_total", decision=decision, reason=reason
    )
    return {
        "threshold": count("remote", "threshold"),
        "short": count("local", "short"),
        "no_prefill_worker": count("local", "no_prefill_worker"),
        **{why: count("local", why) for why in FALLBACKS},
    }


def _assert_long_prompts_placed_remotely(cluster, r: httpx.Response, before: dict[str, float]) -> None:
    """The batch's short prompt stayed on decode-0 and its two long ones were placed on prefill-0.
    They ran there, unless prefill-0 could not take one then: decode-0 then prefilled it itself,
    counted and logged with why, and the answer is the same (checked by the caller). A prompt
    the router offered no prefill worker for is explained only by prefill-0 leaving its rotation."""
    placed = {k: v - before[k] for k, v in _placements(cluster).items()}
    router_log = cluster.router.tail(15)
    context = f"placements {placed}\ndecode-0 log:\n{cluster.workers['decode-0'].tail(15)}\nrouter log:\n{router_log}"
    if re.search(r"prefill-0 at \S+ leaves rotation", router_log):
        placed["remote_failed"] += placed.pop("no_prefill_worker")
    fell_back = sum(placed[reason] for reason in FALLBACKS)
    assert placed["short"] == 1 and placed["threshold"] + fell_back == 2, context
    if fell_back == 0:
        assert r.headers["X-Disagg-Prefill-Worker"] == "prefill-0", context
    else:
        warnings.warn(f"a long prompt was prefilled on decode-0 after all: {context}", stacklevel=2)


@pytest.mark.timeout(120)
def test_batched_prompts_match_each_prompt_alone(cluster, reference_llm, idle_after):
    rng = random.Random(3)
    vocab = reference_llm.engine.config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (5, 20, 37)]  # local, remote, remote
    params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    e2e_before = cluster.metric("router", "disagg_e2e_request_latency_seconds_count")
    placed_before = _placements(cluster)
    r = _post(cluster, "completions", {"prompt": prompts, **params})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    # each generation is a request of its own in the latency histograms
    assert cluster.metric("router", "disagg_e2e_request_latency_seconds_count") == e2e_before + 3
    _assert_long_prompts_placed_remotely(cluster, r, placed_before)
    # the batch went first: alone, the prompts find their blocks cached on the decode worker
    alone = [
        _post(cluster, "completions", {"prompt": p, **params}).json()["choices"][0]["text"] for p in prompts
    ]
    want = [o.outputs[0].text for o in reference_llm.generate(prompts, SamplingParams(**params))]
    assert alone == want
    assert [c["text"] for c in body["choices"]] == alone
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == 5 + 20 + 37 and body["usage"]["completion_tokens"] == 24

    # text prompts, n=2 greedy: identical samples, indices prompt_index * n + sample_index
    texts = ["The quick brown fox", "Once upon a time, in a land far away, there lived"]
    r = _post(cluster, "completions", {"prompt": texts, "n": 2, **params})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    want = [o.outputs[0].text for o in reference_llm.generate(texts, SamplingParams(**params))]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == [want[0], want[0], want[1], want[1]]
    assert r.json()["usage"]["completion_tokens"] == 32


@pytest.mark.timeout(120)
def test_seeded_n3_is_reproducible_and_samples_differ(cluster, idle_after):
    body = {"messages": [{"role": "user", "content": "Name three colours."}], "n": 3, "seed": 1234,
            "temperature": 1.0, "max_tokens": 12, "ignore_eos": True}  # fmt: skip
    first, second = (_post(cluster, "chat/completions", body).json() for _ in range(2))
    texts = [c["message"]["content"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert texts == [c["message"]["content"] for c in second["choices"]]
    assert len(set(texts)) == 3, texts
    # sample i is the request with seed + i
    single = _post(cluster, "chat/completions", {**body, "n": 1, "seed": 1235}).json()
    assert single["choices"][0]["message"]["content"] == texts[1]
    # the prompt is counted once, not once per sample
    assert first["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert first["usage"]["completion_tokens"] == 36
    # without a seed the samples are independent draws
    unseeded = _post(cluster, "chat/completions", {**body, "seed": None}).json()
    assert len({c["message"]["content"] for c in unseeded["choices"]}) == 3


@pytest.mark.timeout(120)
def test_openai_client_streams_n2_interleaved(cluster, idle_after):
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Write a line about the sea, and one about the hills."}]
    kwargs = dict(model=cluster.model_name, messages=messages, n=2, seed=7, temperature=1.0, max_tokens=10,
                  extra_body={"ignore_eos": True})  # fmt: skip
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    texts, finishes, order, usages, roles = {0: "", 1: ""}, {}, [], [], {}
    for chunk in stream:
        if chunk.usage:
            usages.append(chunk.usage)
            assert not chunk.choices
        for choice in chunk.choices:
            assert choice.index not in finishes, "a chunk after its choice's final chunk"
            order.append(choice.index)
            roles.setdefault(choice.index, choice.delta.role)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"} and roles == {0: "assistant", 1: "assistant"}
    assert sorted(set(order)) == [0, 1] and len(usages) == 1
    assert usages[0].completion_tokens == 20
    whole = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]
    assert usages[0].prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.timeout(120)
def test_streamed_batch_ends_once_with_usage(cluster, idle_after):
    body = {"model": cluster.model_name, "prompt": [[11, 12, 13], list(range(20, 50))], "n": 2, "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    events = []
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24
    assert chunks[-1]["usage"]["prompt_tokens"] == 3 + 30
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks[:-1])
    text = {i: "" for i in range(4)}
    finals = {i: 0 for i in range(4)}
    for c in chunks[:-1]:
        choice = c["choices"][0]
        text[choice["index"]] += choice["text"]
        finals[choice["index"]] += choice["finish_reason"] is not None
    assert finals == {0: 1, 1: 1, 2: 1, 3: 1}
    assert text[0] == text[1] and text[2] == text[3] and text[0]


@pytest.mark.timeout(120)
def test_one_failed_generation_aborts_its_siblings(cluster, idle_after):
    aborts = _finished(cluster, "router", "abort")
    # the router accepts the long prompt (it knows the model's full context); the workers, run
    # with a shorter one, refuse it while the siblings are still generating. The siblings are short
    # (prefilled on the decode worker), so they are cancelled in decode, not mid-transfer.
    prompts = [[7] * 5, [8] * 6, [9] * (WORKER_CONTEXT + 10)]
    r = _post(cluster, "completions", {"prompt": prompts, "n": 2, "max_tokens": 200, "ignore_eos": True})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request" and "max_model_len" in r.json()["error"]["message"]
    assert _finished(cluster, "router", "abort") >= aborts + 4  # the four short generations at least
    # streamed, the failure comes before the first byte: still an HTTP error
    r = _post(
        cluster, "completions", {"prompt": prompts, "max_tokens": 200, "ignore_eos": True, "stream": True}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"


@pytest.mark.timeout(120)
def test_siblings_cancelled_as_their_remote_prefill_starts_leave_no_transfer_record(cluster, idle_after):
    """Long siblings go to the prefill worker; the failing prompt cancels them while their
    transfer records are being written. `idle_after` checks Redis holds no record afterwards."""
    prompts = [[7] * 10, [8] * 30, [9] * (WORKER_CONTEXT + 10)]
    for _ in range(3):
        r = _post(cluster, "completions", {"prompt": prompts, "n": 2, "max_tokens": 200, "ignore_eos": True})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text


@pytest.mark.timeout(120)
def test_client_disconnect_aborts_every_generation(cluster, idle_after):
    body = {"model": cluster.model_name, "prompt": [list(range(10, 40)), [5, 6, 7]], "n": 2, "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    aborted = _finished(cluster, "decode-0", "abort")
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as r:
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if len(seen) >= 2:
                break  # hang up mid-stream
    load = cluster.wait_idle()["decode-0"]
    assert load.running == 0 and load.used_blocks == 0
    # all four were cut short on the worker, not left to run out their 200 tokens
    assert _finished(cluster, "decode-0", "abort") == aborted + 4


@pytest.fixture(scope="module")
def two_workers(tiny_model, tmp_path_factory):
    c = Cluster(
        tiny_model, tmp_path_factory.mktemp("batch-kill"), redis_url=None, prefill=0, decode=0, both=2
    )
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.mark.timeout(120)
def test_worker_killed_mid_stream_moves_its_sample_to_the_sibling_worker(two_workers):
    """n=2 greedy samples on two workers; one worker dies mid-stream: its sample resumes on the
    other, and both samples (the same greedy text) complete in one stream."""
    body = {"model": two_workers.model_name, "prompt": list(range(10, 30)), "n": 2, "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    events, seen = [], set()
    with httpx.stream("POST", f"{two_workers.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        # each sample was routed on its own: the router's in-flight count spreads them
        served = r.headers["X-Disagg-Decode-Worker"].split(",")
        assert sorted(served) == ["both-0", "both-1"]
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if line[6:] == "[DONE]":
                break
            seen.add(json.loads(line[6:]).get("choices", [{}])[0].get("index"))
            if seen == {0, 1} and two_workers.workers["both-1"].alive():
                two_workers.workers["both-1"].kill()
    assert events[-1] == "[DONE]", events[-2:]
    texts = {0: "", 1: ""}
    for e in events[:-1]:
        for ch in json.loads(e)["choices"]:
            texts[ch["index"]] += ch["text"]
    assert texts[0] == texts[1] and texts[0]  # nothing lost or repeated at the move
    survivor = two_workers.wait_idle()["both-0"]
    assert survivor.running == 0 and survivor.used_blocks == 0 and survivor.inflight_requests == 0
