"""The router's HTTP app in-process, over an empty worker pool: for tests of the HTTP layer."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from disagg.worker.router.app import Router
from disagg.worker.router.args import RouterArgs
from disagg.worker.router.workers import WorkerPool


async def router_client(
    tokenizer, api_keys: frozenset[str] = frozenset(), args: RouterArgs | None = None, **settings
) -> TestClient:
    """A started test client of a router for the tiny model (64-token context) with `settings`
    (or `args` as given)."""
    args = args or RouterArgs(max_model_len=64, **settings)
    router = Router(args, tokenizer, WorkerPool(None, []), model_name="tiny", api_keys=api_keys)
    client = TestClient(TestServer(router.app()))
    await client.start_server()
    return client
