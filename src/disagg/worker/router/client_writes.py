"""Writes to a client's connection under a deadline (`--client-write-timeout`).

aiohttp's `write` waits (drains) once the connection's transport holds more than its high-water
mark, and then for as long as the client does not read. Without a deadline, a client that opens a
stream and never reads keeps its handler, its generations and their KV blocks on the workers for
as long as it keeps the connection open. Here the transport holds at most WRITE_BUFFER_BYTES
before a write waits, and a write that waits past the deadline disconnects the client: the
connection is aborted (its unsent bytes dropped), the client counted in
disagg_router_slow_clients_total, and `SlowClient` raised, so that the response writer stops and
cancels the generations still running (each aborts on its worker)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

# Bytes a connection's transport buffers before a write waits for the client to read some
# (asyncio's own default, set here so that the bound does not depend on it); the kernel's socket
# buffer comes on top.
WRITE_BUFFER_BYTES = 64 << 10


class SlowClient(Exception):
    """The client did not read its answer in time; its connection is closed. `response` is the
    one being written, for the handler to return (aiohttp then finds the connection gone)."""

    def __init__(self, response: web.StreamResponse):
        super().__init__("the client did not read its answer within --client-write-timeout")
        self.response = response


class BoundedWrites:
    """One response's writes, each of which must finish within `timeout` seconds."""

    def __init__(
        self,
        request: web.Request,
        response: web.StreamResponse,
        timeout: float,
        on_slow: Callable[[], None],
    ):
        self.request = request
        self.response = response
        self.timeout = timeout
        self.on_slow = on_slow
        transport = request.transport
        if transport is not None:
            transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)

    async def prepare(self) -> None:
        await self._bounded(self.response.prepare(self.request))

    async def write(self, data: bytes) -> None:
        await self._bounded(self.response.write(data))

    async def write_eof(self) -> None:
        await self._bounded(self.response.write_eof())

    async def _bounded(self, write: Awaitable) -> None:
        # asyncio.timeout, not wait_for: no task per write (a stream writes once per token chunk),
        # only a timer, and a write that does not wait returns before it fires
        try:
            async with asyncio.timeout(self.timeout):
                await write
        except TimeoutError:
            self.on_slow()
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            raise SlowClient(self.response) from None
