"""Writes under --client-write-timeout, against a fake transport: a write the client does not let
finish disconnects it (counted once, the connection aborted); one that finishes costs nothing."""

from __future__ import annotations

import asyncio

import pytest

from disagg.worker.router.client_writes import WRITE_BUFFER_BYTES, BoundedWrites, SlowClient


class _Transport:
    def __init__(self):
        self.limits: list[int] = []
        self.aborted = 0

    def set_write_buffer_limits(self, high=None, low=None):
        self.limits.append(high)

    def abort(self):
        self.aborted += 1


class _Request:
    def __init__(self):
        self.transport = _Transport()


class _Response:
    """A response whose writes wait for `drained` (a client that reads), or return at once."""

    def __init__(self, blocks: bool):
        self.drained = asyncio.get_running_loop().create_future()
        if not blocks:
            self.drained.set_result(None)
        self.written: list[bytes] = []

    async def prepare(self, request):
        await self.drained

    async def write(self, data: bytes):
        await self.drained
        self.written.append(data)

    async def write_eof(self):
        await self.drained


async def test_a_client_that_reads_is_written_to_and_not_counted():
    request, slow = _Request(), []
    writes = BoundedWrites(request, _Response(blocks=False), 0.001, lambda: slow.append(1))
    await writes.prepare()
    await writes.write(b"chunk")
    await writes.write_eof()
    assert writes.response.written == [b"chunk"] and slow == [] and request.transport.aborted == 0
    assert request.transport.limits == [WRITE_BUFFER_BYTES]  # its connection buffers a bounded amount


@pytest.mark.parametrize("step", ["prepare", "write", "write_eof"])
async def test_a_write_that_waits_past_the_deadline_disconnects_the_client(step):
    request, slow = _Request(), []
    response = _Response(blocks=True)  # a client that never reads
    writes = BoundedWrites(request, response, 0.001, lambda: slow.append(1))
    call = writes.write(b"chunk") if step == "write" else getattr(writes, step)()
    with pytest.raises(SlowClient) as info:
        await call
    assert info.value.response is response
    assert slow == [1] and request.transport.aborted == 1 and response.written == []
