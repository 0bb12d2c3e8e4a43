"""The KV handshakes a decode worker holds with prefill workers (its asyncio side)."""

from __future__ import annotations

import asyncio

from disagg.proto import worker_pb2 as pb
from disagg.worker.serving.attempt import PrefillFailed


class PeerHandshakes:
    """`ensure(target)` before a Prefill call to it; `forget(worker_id)` when the peer may have
    lost ours (it asked for a handshake, or its connection broke). `payload()` gives this
    worker's handshake (from the engine loop, which owns the transport)."""

    def __init__(self, worker_id: str, address: str, payload, stubs):
        self.worker_id = worker_id
        self.address = address
        self._payload = payload
        self._stubs = stubs
        self._done: set[str] = set()  # prefill workers whose KV handshake we hold
        self._locks: dict[str, asyncio.Lock] = {}

    def forget(self, worker_id: str) -> None:
        self._done.discard(worker_id)

    async def ensure(self, target: pb.PrefillTarget) -> None:
        # one handshake per peer at a time: concurrent requests to a new peer wait for the first
        lock = self._locks.setdefault(target.worker_id, asyncio.Lock())
        async with lock:
            if target.worker_id in self._done:
                return
            payload = await self._payload()
            resp = await self._stubs.stub(target.address).Handshake(
                pb.HandshakeRequest(worker_id=self.worker_id, address=self.address, payload=payload),
                timeout=10.0,
            )
            if resp.error.code:
                raise PrefillFailed(f"handshake with {target.worker_id} refused: {resp.error.message}")
            self._done.add(target.worker_id)
