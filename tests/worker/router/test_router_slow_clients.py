"""Clients that do not read their answer: a real router (aiohttp over TCP, a scripted worker) and a
raw socket with a tiny receive buffer that never reads. Such a client is disconnected once a write
to it waits past --client-write-timeout, its generation aborted on the worker and counted; and a
generation that ended on its worker frees its queue slot whatever its client has read."""

from __future__ import annotations

import asyncio
import json
import socket

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import REGISTRY

from disagg.worker.router.app import Router
from disagg.worker.router.args import RouterArgs

from .fake_worker import FakePool, messages

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
# far more output than the socket buffers between the router and a client that never reads hold
# (the client's tiny receive window, the kernel's send buffer, the transport's)
BIG = messages(["x" * (16 << 10)] * 1024, "length")


def _slow_clients() -> float:
    value = REGISTRY.get_sample_value("disagg_router_slow_clients_total", {"role": "router", "model": "tiny"})
    return value or 0.0


async def _until(ready, what: str) -> None:
    """Wait for `ready()` (an event the router causes), failing with `what` if it never comes."""
    for _ in range(1000):
        if ready():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


def _never_reads(port: int, body: dict) -> socket.socket:
    """A client that sends its request and then reads nothing."""
    s = socket.socket()
    # before connecting, so that the window it offers the router stays as small as the kernel allows
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    return s


async def _router(tokenizer, pool: FakePool, **settings) -> tuple[TestClient, Router]:
    args = RouterArgs(max_model_len=256, max_queue=1, **settings)
    router = Router(args, tokenizer, pool, model_name="tiny")
    client = TestClient(TestServer(router.app()))
    await client.start_server()
    return client, router


def _first_big(pool: FakePool):
    """The first request gets BIG, every later one a short answer."""
    return lambda req: BIG if len(pool.requests) == 1 else messages(["a"], "stop")


async def test_a_stream_nobody_reads_is_cut_at_the_write_deadline_and_aborted_on_the_worker(tokenizer):
    pool = FakePool(lambda req: [], hold_open=lambda req: len(pool.requests) == 1)  # still generating
    pool.script = _first_big(pool)
    client, router = await _router(tokenizer, pool, client_write_timeout=0.2)
    before = _slow_clients()
    slow = _never_reads(client.port, {**CHAT, "stream": True})
    try:
        await _until(lambda: _slow_clients() == before + 1, "the slow client counted")
        await _until(lambda: pool.aborts == [pool.requests[0].request_id], "the worker told to abort")
        await _until(lambda: router.admission.inflight == 0, "its slot freed")
        r = await client.post("/v1/chat/completions", json=CHAT)  # served, not 429
        assert r.status == 200, await r.text()
        assert _slow_clients() == before + 1
    finally:
        slow.close()
        await client.close()


async def test_a_generation_that_ended_on_its_worker_frees_its_slot_while_its_bytes_wait(tokenizer):
    """Queue slots count generations in flight, not bytes unsent: the worker is done, the client
    has not read, and the next request is served (the write deadline is far off here)."""
    pool = FakePool(lambda req: [])
    pool.script = _first_big(pool)
    client, router = await _router(tokenizer, pool, client_write_timeout=3600.0)
    slow = _never_reads(client.port, {**CHAT, "stream": True})
    try:
        await _until(lambda: pool.ended == 1, "the first generation ending on its worker")
        await _until(lambda: router.admission.inflight == 0, "its slot freed")
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status == 200, await r.text()
        assert pool.aborts == []  # nothing was cut: it finished
    finally:
        slow.close()
        await client.close()


async def test_a_whole_body_nobody_reads_is_cut_at_the_write_deadline(tokenizer):
    pool = FakePool(lambda req: [])
    pool.script = _first_big(pool)
    client, router = await _router(tokenizer, pool, client_write_timeout=0.2)
    before = _slow_clients()
    slow = _never_reads(client.port, CHAT)
    try:
        await _until(lambda: _slow_clients() == before + 1, "the slow client counted")
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status == 200, await r.text()
    finally:
        slow.close()
        await client.close()
