"""gRPC stubs of other workers, one cached channel per address (router and decode workers both call out)."""

from __future__ import annotations

import grpc

from disagg.proto import worker_pb2_grpc

# Large prompts (token ids) and KV-free control messages: 64 MiB is plenty.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    # reconnect quickly to a worker that (re)started: the default backoff grows to two minutes
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class WorkerStubs:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
            self._channels[address] = ch
        return worker_pb2_grpc.WorkerStub(ch)

    async def drop(self, address: str) -> None:
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close()

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()
