"""KV block transfer between workers: one interface, two transports ("nixl" default, "grpc" fallback).

    layout = KVLayout.from_tensor(kv_cache, model_id)
    transport = create_transport("nixl", kv_cache, layout, name=worker_id)
    payload = transport.handshake_payload()          # ship via the Worker.Handshake RPC
    peer_transport.add_peer(worker_id, payload)      # on the other side
See base.KVTransport for the sender/receiver protocol.
"""

from __future__ import annotations

import torch

from disagg.worker.kv_transfer.base import KVTransport
from disagg.worker.kv_transfer.errors import IncompatiblePeer, KVTransferError, UnknownPeer
from disagg.worker.kv_transfer.handle import DONE, ERROR, PENDING, TransferHandle
from disagg.worker.kv_transfer.layout import PROTOCOL_VERSION, KVLayout

BACKENDS = ("nixl", "grpc")

__all__ = [
    "BACKENDS", "DONE", "ERROR", "PENDING", "PROTOCOL_VERSION", "IncompatiblePeer", "KVLayout",
    "KVTransferError", "KVTransport", "TransferHandle", "UnknownPeer", "create_transport",
]  # fmt: skip


def create_transport(
    kind: str, kv_cache: torch.Tensor, layout: KVLayout, name: str, **options
) -> KVTransport:
    """kind "nixl" (options: default_timeout, stall_timeout, descriptors="auto"|"prepped"|"merged")
    or "grpc" (default_timeout, stall_timeout, advertise_address, chunk_bytes; mount
    `transport.servicer()` on the worker's gRPC server)."""
    if kind == "nixl":
        from disagg.worker.kv_transfer.nixl_transport import NixlTransport

        return NixlTransport(kv_cache, layout, name, **options)
    if kind == "grpc":
        from disagg.worker.kv_transfer.grpc_transport import GrpcTransport

        return GrpcTransport(kv_cache, layout, name, **options)
    raise ValueError(f"kind: unknown KV transport {kind!r} (choose from {', '.join(BACKENDS)})")
