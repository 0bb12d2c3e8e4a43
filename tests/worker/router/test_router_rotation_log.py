"""The router logs every change of a worker's rotation state with its reason (a 503 "no worker is
ready" is otherwise a mystery), against a real gRPC server answering Load and Health."""

from __future__ import annotations

import logging

import grpc
import pytest

from disagg.proto import worker_pb2 as pb
from disagg.proto import worker_pb2_grpc
from disagg.worker.cli.ports import free_port
from disagg.worker.router.workers import WorkerPool


class _Worker(worker_pb2_grpc.WorkerServicer):
    draining = False

    async def Load(self, request, context):
        return pb.LoadResponse(worker_id="decode-7", role="decode", free_blocks=8, total_blocks=8)

    async def Health(self, request, context):
        return pb.HealthResponse(
            ready=True, worker_id="decode-7", role="decode", model="m", draining=self.draining
        )


async def _serve(servicer, address: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    await server.start()
    return server


@pytest.mark.asyncio
async def test_each_rotation_change_is_logged_with_its_reason(caplog):
    caplog.set_level(logging.INFO, logger="disagg.router.workers")
    address, worker = f"127.0.0.1:{free_port()}", _Worker()
    server = await _serve(worker, address)
    pool = WorkerPool(None, [address], model="m")
    try:
        await pool.refresh()
        assert [v.worker_id for v in pool.views()] == ["decode-7"]
        await pool.refresh()  # no change, no line
        worker.draining = True
        await pool.refresh()
        pool.mark_failed("decode-7")  # already out: no second line
        worker.draining = False
        await pool.refresh()
        pool.mark_failed("decode-7")
        await pool.refresh()  # answers again: back in
        await server.stop(None)
        await pool.refresh()
        assert pool.views() == []
    finally:
        await pool.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "disagg.router.workers"]
    assert lines[0] == f"decode-7 at {address} joins rotation: ready"
    assert lines[1] == f"decode-7 at {address} leaves rotation: draining"
    assert lines[2] == f"decode-7 at {address} joins rotation: ready"
    assert lines[3] == f"decode-7 at {address} leaves rotation: a call to it failed"
    assert lines[4] == f"decode-7 at {address} joins rotation: ready"
    assert lines[5].startswith(f"decode-7 at {address} leaves rotation: poll failed (UNAVAILABLE: ")
    assert len(lines) == 6, lines


@pytest.mark.asyncio
async def test_next_refresh_waits_for_a_poll_of_the_pool():
    """A request that finds no worker in rotation waits for the next poll (app.py) before a 503:
    a worker that rejoins within it is found."""
    address, worker = f"127.0.0.1:{free_port()}", _Worker()
    worker.draining = True
    server = await _serve(worker, address)
    pool = WorkerPool(None, [address], refresh_seconds=0.2, model="m")
    try:
        await pool.start()
        assert pool.views() == []
        worker.draining = False
        await pool.next_refresh(timeout=5)
        assert [v.worker_id for v in pool.views()] == ["decode-7"]
        await pool.stop()
        await pool.next_refresh(timeout=0.3)  # nothing polls any more: it gives up at the timeout
    finally:
        await pool.stop()
        await server.stop(None)
