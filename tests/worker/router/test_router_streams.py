"""The router's streams and bodies against a scripted worker (tests/worker/router/fake_worker.py):
usage in every chunk when asked, truncated forced tool calls, and latency measured from arrival."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from disagg.worker.router.app import Router
from disagg.worker.router.args import RouterArgs

from .fake_worker import FakePool, messages


async def _client(tokenizer, pool: FakePool, **kw) -> tuple[TestClient, Router]:
    router = Router(RouterArgs(max_model_len=256), tokenizer, pool, model_name="tiny", **kw)
    client = TestClient(TestServer(router.app()))
    await client.start_server()
    return client, router


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT),
                                        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 8})])  # fmt: skip
async def test_continuous_usage_stats_puts_usage_in_every_chunk(tokenizer, path, body):
    pool = FakePool(lambda req: messages(["a", "b", "c"], "length", prompt_tokens=len(req.prompt_token_ids)))
    client, _ = await _client(tokenizer, pool)
    try:
        opts = {"include_usage": True, "continuous_usage_stats": True}
        r = await client.post(path, json={**body, "stream": True, "stream_options": opts})
        assert r.status == 200, await r.text()
        events = _events(await r.text())
        prompt = len(pool.requests[0].prompt_token_ids)
        content = [e for e in events if e["choices"]]
        assert [e["usage"]["completion_tokens"] for e in content] == [1, 2, 3]
        assert all(e["usage"]["prompt_tokens"] == prompt for e in content)
        assert all(e["usage"]["total_tokens"] == prompt + e["usage"]["completion_tokens"] for e in content)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
        # without it, chunks carry usage null (include_usage) as before
        r = await client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
        assert all(e["usage"] is None for e in _events(await r.text()) if e["choices"])
    finally:
        await client.close()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _observed(router: Router, name: str) -> tuple[float, float]:
    """(count, sum) of one of the router's histograms."""
    text = router.metrics.exposition().decode()
    count = sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(f"{name}_count"))
    total = sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(f"{name}_sum"))
    return count, total


async def test_ttft_is_from_arrival_to_the_first_chunk_written(tokenizer):
    """The first token's text is held back (an incomplete character): the client's first byte is
    the second token's chunk, and the router's TTFT says so."""
    clock = Clock()
    script = messages(["", "a", "b"], "stop")  # tokens at t = 10, 20, 30

    def at(i: int) -> None:
        clock.now = 10.0 * (i + 1)

    client, router = await _client(tokenizer, FakePool(lambda req: script, on_message=at), clock=clock)
    names = ("disagg_time_to_first_token_seconds", "disagg_e2e_request_latency_seconds")
    try:
        before = [_observed(router, n) for n in names]  # the histograms are shared by the module's routers
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status == 200 and "[DONE]" in await r.text()
        after = [_observed(router, n) for n in names]
        (ttft_n, ttft), (e2e_n, e2e) = [
            (a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)
        ]
        assert (ttft_n, ttft) == (1, 20.0)
        assert (e2e_n, e2e) == (1, 30.0)
    finally:
        await client.close()


@pytest.mark.parametrize(
    "body, kind",
    [
        (CHAT, "chat.completion"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 8}, "text_completion"),
        ({"model": "tiny", "input": "hi", "max_output_tokens": 8}, "response"),
    ],
)
async def test_invocations_answers_as_the_api_the_body_is_for(tokenizer, body, kind):
    client, _ = await _client(tokenizer, FakePool(lambda req: messages(["a", "b"], "length")))
    try:
        r = await client.post("/invocations", json=body)
        answer = await r.json()
        assert r.status == 200 and answer["object"] == kind, answer
        streamed = await client.post("/invocations", json={**body, "stream": True})
        assert streamed.status == 200 and "text/event-stream" in streamed.headers["Content-Type"]
    finally:
        await client.close()


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "tiny"}, None),
        ({**CHAT, "temperature": 9}, "temperature"),
        ({"model": "tiny", "prompt": "hi", "bogus": 1}, "bogus"),
    ],
)
async def test_invocations_refuses_what_its_api_would(tokenizer, body, param):
    client, _ = await _client(tokenizer, FakePool(lambda req: messages(["a"], "length")))
    try:
        r = await client.post("/invocations", json=body)
        assert r.status == 400 and (await r.json())["error"]["param"] == param
        r = await client.post("/invocations", data=b"[1]", headers={"Content-Type": "application/json"})
        assert r.status == 400
    finally:
        await client.close()


async def test_prefill_targets_carry_the_prefix_each_one_holds(tokenizer):
    """The decode worker prices a remote prefill with what the prefill worker holds: the prefix
    index's match, in tokens, goes with each candidate."""
    from disagg.worker.router.policy import WorkerView

    pool = FakePool(lambda req: messages(["a"], "length"))
    decode = WorkerView("d0", "decode", "fake:0", free_blocks=100, total_blocks=100)
    holders = [WorkerView(w, "prefill", f"fake:{i + 1}", free_blocks=100, total_blocks=100)
               for i, w in enumerate(("p0", "p1"))]  # fmt: skip
    pool.views = lambda: [decode, *holders]
    client, _ = await _client(tokenizer, pool, prefix_lookup=lambda hashes: {"p1": 2, "d0": 1})
    try:
        prompt = list(range(40, 90))  # 3 full blocks of 16
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
        assert r.status == 200, await r.text()
        targets = pool.requests[0].prefill_targets
        assert [(t.worker_id, t.cached_tokens) for t in targets] == [("p1", 32), ("p0", 0)]
    finally:
        await client.close()


async def test_the_worker_is_told_how_many_tokens_to_gather_for_a_streaming_and_a_whole_response(tokenizer):
    pool = FakePool(lambda req: messages(["a", "b"], "length"))
    args = RouterArgs(max_model_len=256, stream_interval=3, nonstreaming_interval=7)
    client = TestClient(TestServer(Router(args, tokenizer, pool, model_name="tiny").app()))
    await client.start_server()
    try:
        for stream in (True, False):
            r = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
            assert r.status == 200, await r.text()
        assert [req.stream_interval for req in pool.requests] == [3, 7]
    finally:
        await client.close()
