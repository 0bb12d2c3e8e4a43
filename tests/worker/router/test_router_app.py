"""The router's HTTP layer in-process (no workers): auth, errors, models, admission."""

from __future__ import annotations

from .router_client import router_client as _client

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


async def test_api_keys(tokenizer):
    client = await _client(tokenizer, api_keys=frozenset({"secret"}))
    try:
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status == 401
        assert (await r.json())["error"]["type"] == "authentication_error"
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"})
        assert r.status == 401
        r = await client.get("/v1/models", headers={"Authorization": "Bearer secret"})
        assert r.status == 200
        assert [m["id"] for m in (await r.json())["data"]] == ["tiny"]
        # a good key gets past auth: 503 because no worker is ready
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer secret"})
        assert r.status == 503 and "Retry-After" in r.headers
    finally:
        await client.close()


async def test_errors_in_openai_shape(tokenizer):
    client = await _client(tokenizer)
    try:
        r = await client.post(
            "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert r.status == 400
        body = await r.json()
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_json"
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1})
        assert r.status == 400 and (await r.json())["error"]["param"] == "max_tokens"
        r = await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        r = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": list(range(60)), "max_tokens": 10}
        )
        body = await r.json()
        assert r.status == 400 and body["error"]["code"] == "context_length_exceeded", body
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": [10**7]})
        assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
        r = await client.get("/health")
        assert r.status == 503
        r = await client.get("/metrics")
        assert r.status == 200 and "disagg_requests_rejected_total" in await r.text()
    finally:
        await client.close()


async def test_queue_full_is_429_with_retry_after(tokenizer):
    client = await _client(tokenizer, max_queue=0)
    try:
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status == 429
        assert r.headers["Retry-After"] == "1"
        assert (await r.json())["error"]["code"] == "queue_full"
    finally:
        await client.close()


async def test_unsupported_endpoints_are_404s_naming_them(tokenizer):
    client = await _client(tokenizer)
    try:
        for method, path in [("POST", "/v1/embeddings"), ("POST", "/v1/images/generations"),
                             ("GET", "/v1/files"), ("POST", "/v1/audio/speech")]:  # fmt: skip
            r = await client.request(method, path, json={"model": "tiny", "input": "x"})
            body = await r.json()
            assert r.status == 404 and body["error"]["code"] == "unsupported_endpoint", body
            assert path in body["error"]["message"] and body["error"]["type"] == "not_found_error"
        r = await client.get("/v1/chat/completions")  # a served endpoint, wrong method: not a 404
        assert r.status == 405
    finally:
        await client.close()
