"""What a web page can make its visitor's browser do to a router: a JSON body only as
application/json (other types need no CORS preflight, so any page could send them), and
cross-origin calls only from the origins --allowed-origins names (none by default)."""

from __future__ import annotations

import json

import pytest

from disagg.worker import cli
from disagg.worker.router.args import RouterArgs

from .router_client import router_client as _client

POSTS = {
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "tiny", "input": "hi"},
    "/invocations": {"model": "tiny", "prompt": "hi", "max_tokens": 1},
    "/tokenize": {"model": "tiny", "prompt": "hi"},
    "/detokenize": {"model": "tiny", "tokens": [5]},
}
PAGE = "https://app.example.com"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip


def _cors_headers(r) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.lower().startswith("access-control-")}


@pytest.mark.parametrize("path", list(POSTS))
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
async def test_a_json_body_sent_as_another_type_is_a_415_naming_the_header(tokenizer, path, content_type):
    client = await _client(tokenizer)
    try:
        headers = {"Content-Type": content_type} if content_type else {}
        skip = () if content_type else ("Content-Type",)
        r = await client.post(path, data=json.dumps(POSTS[path]), headers=headers, skip_auto_headers=skip)
        body = await r.json()
        assert r.status == 415 and "Content-Type" in body["error"]["message"], body
        assert (
            body["error"]["type"] == "invalid_request_error"
            and body["error"]["code"] == "unsupported_media_type"
        )
    finally:
        await client.close()


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=utf-8"])
async def test_application_json_with_parameters_in_any_case_is_read(tokenizer, content_type):
    client = await _client(tokenizer)
    try:
        for path, body in POSTS.items():
            r = await client.post(path, data=json.dumps(body), headers={"Content-Type": content_type})
            assert r.status != 415, (path, await r.text())
            assert r.status in (200, 503), (path, await r.text())  # read; 503: this pool has no worker
    finally:
        await client.close()


async def test_by_default_no_origin_may_call_it_from_a_browser(tokenizer):
    client = await _client(tokenizer)
    try:
        r = await client.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status == 403 and _cors_headers(r) == {}
        r = await client.get("/v1/models", headers={"Origin": PAGE})
        assert r.status == 200 and _cors_headers(r) == {}
        # an OPTIONS that is no preflight is what it was: a method the path does not take
        r = await client.options("/v1/chat/completions")
        assert r.status == 405 and r.headers["Allow"] == "POST"
    finally:
        await client.close()


async def test_an_allowed_origin_gets_its_preflight_answered_and_may_read_every_answer(tokenizer):
    client = await _client(tokenizer, allowed_origins=f"https://other.example, {PAGE}")
    try:
        r = await client.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status == 204, await r.text()
        assert r.headers["Access-Control-Allow-Origin"] == PAGE
        assert r.headers["Access-Control-Allow-Methods"] == "POST"
        allowed = {h.strip().lower() for h in r.headers["Access-Control-Allow-Headers"].split(",")}
        assert {"authorization", "content-type"} <= allowed
        r = await client.options("/v1/models", headers={**PREFLIGHT, "Access-Control-Request-Method": "GET"})
        assert r.status == 204 and r.headers["Access-Control-Allow-Methods"] == "GET, HEAD"
        # its answers, errors included (503: no worker), carry the header; others' do not
        r = await client.post(
            "/v1/chat/completions", json=POSTS["/v1/chat/completions"], headers={"Origin": PAGE}
        )
        assert r.status == 503 and r.headers["Access-Control-Allow-Origin"] == PAGE
        assert "Origin" in r.headers.getall("Vary")
        r = await client.options(
            "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"}
        )
        assert r.status == 403 and _cors_headers(r) == {}
        r = await client.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert _cors_headers(r) == {}
    finally:
        await client.close()


async def test_a_star_lets_any_origin_call_it(tokenizer):
    client = await _client(tokenizer, allowed_origins="*")
    try:
        r = await client.options("/tokenize", headers={**PREFLIGHT, "Origin": "https://any.example"})
        assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "*"
        r = await client.get("/v1/models", headers={"Origin": "https://any.example"})
        assert r.headers["Access-Control-Allow-Origin"] == "*"
    finally:
        await client.close()


@pytest.mark.parametrize("value", ["app.example.com", "https://app.example.com/", "https://a.example/v1"])
def test_allowed_origins_takes_origins_only(value):
    with pytest.raises(ValueError, match="allowed-origins"):
        RouterArgs(allowed_origins=value)


def test_disagg_up_hands_the_router_its_client_settings():
    from disagg.worker.cli import router, up

    sent = RouterArgs.cli_args(client_write_timeout=5.0, allowed_origins=PAGE)  # in field order
    _, args = cli.parse(["up", *sent])
    flags = up.router_args(args).to_cli_args()
    assert flags == sent
    _, args = cli.parse(["router", *flags])
    got = router.router_args(args)
    assert (got.allowed_origins, got.client_write_timeout) == (PAGE, 5.0)
