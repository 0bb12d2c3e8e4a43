"""vLLM's /tokenize, /detokenize (completion and chat forms), /ping and /version on the router."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from disagg.worker.router.app import Router
from disagg.worker.router.args import RouterArgs
from disagg.worker.router.workers import WorkerPool


@pytest.fixture
async def client(tokenizer):
    args = RouterArgs(max_model_len=64, max_prompt_bytes=1000)
    router = Router(args, tokenizer, WorkerPool(None, []), model_name="tiny")
    c = TestClient(TestServer(router.app()))
    await c.start_server()
    yield c
    await c.close()


async def test_tokenize_a_prompt_and_back(client, tokenizer):
    r = await client.post(
        "/tokenize", json={"model": "tiny", "prompt": "Hello world", "return_token_strs": True}
    )
    body = await r.json()
    assert r.status == 200, body
    assert body["tokens"] == tokenizer.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 64 and len(body["token_strs"]) == body["count"]
    plain = await (
        await client.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False})
    ).json()
    assert (
        plain["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
        and plain["token_strs"] is None
    )
    r = await client.post("/detokenize", json={"tokens": plain["tokens"]})
    assert r.status == 200 and (await r.json())["prompt"] == "Hello world"


async def test_tokenize_chat_messages_as_a_chat_request_renders_them(client, tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    r = await client.post("/tokenize", json={"messages": messages})
    body = await r.json()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert r.status == 200 and body["tokens"] == tokenizer.encode(text, add_special_tokens=False), body


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"prompt": ""}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
        ("/tokenize", {"prompt": "x" * 1001}, 400, "prompt"),
        ("/tokenize", {"messages": [{"role": "", "content": "x"}]}, 400, "messages[0].role"),
        ("/tokenize", {"prompt": "x", "bogus": 1}, 400, "bogus"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": [10**8]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
async def test_refusals_name_the_field(client, path, body, status, param):
    r = await client.post(path, json=body)
    err = (await r.json())["error"]
    assert r.status == status and err["param"] == param, err


async def test_ping_and_version(client):
    r = await client.get("/ping")
    assert r.status == 503  # as /health: no worker in this pool
    r = await client.get("/version")
    assert r.status == 200 and isinstance((await r.json())["version"], str)
    r = await client.post("/version")
    assert r.status == 405 and r.headers["Allow"] == "GET, HEAD"
