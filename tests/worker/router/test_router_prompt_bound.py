"""The prompt bound is per request, not per prompt, and checked before any tokenizing: a batch of
prompts each under the limit but together over it is a 400 without one call to the tokenizer."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from disagg.worker.router.app import Router
from disagg.worker.router.args import RouterArgs
from disagg.worker.router.errors import APIError
from disagg.worker.router.validation import check_prompt_size, parse_chat, parse_completion
from disagg.worker.router.workers import WorkerPool


class CountingTokenizer:
    """The tiny model's tokenizer, counting the calls that cost CPU."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, *a, **kw):
        self.calls += 1
        return self.inner.encode(*a, **kw)

    def apply_chat_template(self, *a, **kw):
        self.calls += 1
        return self.inner.apply_chat_template(*a, **kw)


def test_the_bound_is_the_sum_over_the_request():
    spec = parse_completion({"model": "m", "prompt": ["a" * 600, "b" * 600]})
    with pytest.raises(APIError) as info:
        check_prompt_size(spec, max_bytes=1000, max_model_len=64)
    assert info.value.param == "prompt" and info.value.code == "prompt_too_large"
    assert "1200" in info.value.message and "1000" in info.value.message
    check_prompt_size(spec, max_bytes=1200, max_model_len=64)
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x" * 600}] * 2})
    with pytest.raises(APIError) as info:
        check_prompt_size(chat, max_bytes=1000, max_model_len=64)
    assert info.value.param == "messages"


def test_token_id_prompts_longer_than_the_context_are_refused_up_front():
    spec = parse_completion({"model": "m", "prompt": [[1] * 10, [1] * 64]})
    with pytest.raises(APIError) as info:
        check_prompt_size(spec, max_bytes=1000, max_model_len=64)
    assert info.value.code == "context_length_exceeded" and "prompt[1]" in info.value.message


async def test_many_prompts_each_under_the_limit_are_refused_before_tokenizing(tokenizer):
    spy = CountingTokenizer(tokenizer)
    args = RouterArgs(max_model_len=64, max_prompt_bytes=1 << 16)
    router = Router(args, spy, WorkerPool(None, []), model_name="tiny")
    client = TestClient(TestServer(router.app()))
    await client.start_server()
    try:
        body = {"model": "tiny", "prompt": ["lorem ipsum " * 5000] * 30, "max_tokens": 1}  # 30 x 60 kB
        r = await client.post("/v1/completions", json=body)
        err = (await r.json())["error"]
        assert r.status == 400 and err["code"] == "prompt_too_large" and err["param"] == "prompt", err
        assert spy.calls == 0
        assert router.admission.inflight == 0
    finally:
        await client.close()
