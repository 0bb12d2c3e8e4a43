"""The router's streams and bodies against a scripted worker (tests/serving/fake_worker.py):
usage in every chunk when asked, truncated forced tool calls, and latency measured from arrival."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from disagg.worker.router.app import Router, RouterConfig

from .fake_worker import FakePool, messages


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from disagg.worker.engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(tiny_model)


async def _client(tokenizer, pool: FakePool, **kw) -> tuple[TestClient, Router]:
    router = Router(RouterConfig(model_name="tiny", max_model_len=256), tokenizer, pool, **kw)
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
