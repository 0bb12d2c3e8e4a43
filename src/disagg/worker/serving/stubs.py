"""gRPC stubs of other workers, one cached channel per address (router and decode workers both call out)."""

from __future__ import annotations

import grpc

from disagg.proto import worker_pb2_grpc
from disagg.worker.serving.auth import INSECURE, InternalAuth

# Large prompts (token ids) and KV-free control messages: 64 MiB is plenty.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    # A frozen peer (SIGSTOP, a hung node) answers no HTTP/2 ping: its calls fail within ~7 s
    # instead of waiting for a reply that never comes. Servers take these options too, so they
    # accept pings this often on streams that carry no data for a while (a long prefill).
    # (keepalive_timeout alone does not fire here: the ping ack deadline is ping_timeout_ms)
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
    # reconnect quickly to a worker that (re)started: the default backoff grows to two minutes
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class WorkerStubs:
    def __init__(self, auth: InternalAuth = INSECURE) -> None:
        self._channels: dict[str, tuple[grpc.aio.Channel, object]] = {}  # address -> channel, its TLS files
        self._retired: list[grpc.aio.Channel] = []
        self._auth = auth

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        """A stub whose calls carry the deployment's internal credential. After the TLS files were
        renewed, a new channel presents the new certificate; calls still on the old one finish there."""
        ch, files = self._channels.get(address, (None, None))
        current = self._auth.tls_files()
        if ch is None or files is not current:
            if ch is not None:
                self._retired.append(ch)
            ch = self._auth.aio_channel(address, options=GRPC_OPTIONS)
            self._channels[address] = (ch, current)
        return self._auth.wrap(worker_pb2_grpc.WorkerStub(ch))

    async def drop(self, address: str) -> None:
        ch, _ = self._channels.pop(address, (None, None))
        if ch is not None:
            await ch.close()

    async def close(self) -> None:
        channels = [ch for ch, _ in self._channels.values()] + self._retired
        self._channels, self._retired = {}, []
        for ch in channels:
            await ch.close()
