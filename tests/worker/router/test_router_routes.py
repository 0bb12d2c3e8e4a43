"""The router's routes as clients call them: a model by id, trailing slashes, 405 with Allow."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from disagg.worker.router.app import Router
from disagg.worker.router.args import RouterArgs
from disagg.worker.router.workers import WorkerPool


@pytest.fixture
async def client(tokenizer):
    router = Router(RouterArgs(max_model_len=64), tokenizer, WorkerPool(None, []), model_name="org/tiny")
    c = TestClient(TestServer(router.app()))
    await c.start_server()
    yield c
    await c.close()


async def test_a_model_by_id(client):
    r = await client.get("/v1/models/org/tiny")
    card = await r.json()
    assert r.status == 200 and card["id"] == "org/tiny" and card["object"] == "model", card
    listed = (await (await client.get("/v1/models")).json())["data"][0]
    assert card == listed
    r = await client.get("/v1/models/gpt-9")
    err = (await r.json())["error"]
    assert r.status == 404 and err["code"] == "model_not_found" and "gpt-9" in err["message"], err


@pytest.mark.parametrize("path", ["/v1/models/", "/v1/models/org/tiny/", "/health/", "/v1/chat/completions/"])
async def test_trailing_slashes_reach_the_route(client, path):
    if "chat" in path:
        r = await client.post(
            path, json={"model": "org/tiny", "messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status == 503  # validated and admitted: no worker in this pool
    else:
        r = await client.get(path)
        assert r.status in (200, 503), await r.text()


@pytest.mark.parametrize(
    "method, path, allow",
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions/", "POST"),
        ("DELETE", "/v1/responses", "POST"),
        ("POST", "/v1/models", "GET, HEAD"),
        ("POST", "/v1/models/org/tiny", "GET, HEAD"),
    ],
)
async def test_wrong_method_is_405_with_allow(client, method, path, allow):
    r = await client.request(method, path)
    assert r.status == 405 and r.headers.get("Allow") == allow, (r.headers, await r.text())
    err = (await r.json())["error"]
    assert err["code"] == "method_not_allowed" and method in err["message"]
