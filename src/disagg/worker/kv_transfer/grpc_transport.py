"""KV transport over a gRPC stream: the fallback for hosts without UCX, and a benchmark baseline.

Sender: each send is one client-streaming PushBlocks call whose chunks carry up to `chunk_bytes`
of one layer's regions; FINAL/ABORT go through the unary Notify. The receiver's server mounts
`KVTransferServicer`, which writes each chunk straight into the reserved blocks of its tensor and
counts a PART once a stream's last byte is written (the ack then tells the sender it is done).

The receiver's address travels in its handshake payload (`advertise_address`), and
`add_peer(..., address=...)` overrides it (e.g. when only the caller knows a routable address).
"""

from __future__ import annotations

import logging
import warnings

import grpc
import numpy as np
import torch

from disagg.proto import kv_transfer_pb2 as pb
from disagg.proto import kv_transfer_pb2_grpc as pb_grpc
from disagg.worker.kv_transfer.base import KVTransport
from disagg.worker.kv_transfer.handle import TransferHandle
from disagg.worker.kv_transfer.handshake import agent_name, decode_handshake, encode_handshake, worker_of
from disagg.worker.kv_transfer.layout import KVLayout
from disagg.worker.kv_transfer.metrics import TRANSFER_REFUSED
from disagg.worker.kv_transfer.region_runs import block_runs

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 << 20
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]

_ERROR_KINDS = {
    grpc.StatusCode.UNAVAILABLE: "disconnect",
    grpc.StatusCode.CANCELLED: "disconnect",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.FAILED_PRECONDITION: "rejected",
    grpc.StatusCode.INVALID_ARGUMENT: "rejected",
}


class _RegionBytes:
    """Reads and writes whole regions of the KV tensor viewed as [layers, blocks, block_bytes] bytes."""

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout):
        self.on_cpu = not kv_cache.is_cuda
        view = kv_cache.view(torch.uint8).view(layout.num_layers, layout.num_blocks, layout.block_bytes)
        self.bytes = view.numpy() if self.on_cpu else view  # numpy: no copies through torch on CPU
        self.block_bytes = layout.block_bytes

    def _rows(self, layer: int, blocks: list[int]):
        """The rows of `blocks`: a plain slice when the ids are consecutive (one copy, no gather)."""
        if len(blocks) == 1 or len(block_runs(blocks)) == 1:
            return self.bytes[layer, blocks[0] : blocks[0] + len(blocks)]
        return None

    def read(self, layer: int, blocks: list[int]) -> bytes:
        if self.on_cpu:
            rows = self._rows(layer, blocks)
            return (self.bytes[layer, blocks] if rows is None else rows).tobytes()
        return self.bytes[layer, torch.tensor(blocks, device=self.bytes.device)].cpu().numpy().tobytes()

    def write(self, layer: int, blocks: list[int], data: bytes) -> None:
        if self.on_cpu:
            src = np.frombuffer(data, dtype=np.uint8).reshape(len(blocks), self.block_bytes)
            rows = self._rows(layer, blocks)
            if rows is None:
                self.bytes[layer, blocks] = src
            else:
                rows[...] = src
            return
        with warnings.catch_warnings():  # torch warns that bytes are read-only; they are only read
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8).view(len(blocks), self.block_bytes)
        self.bytes[layer, torch.tensor(blocks, device=self.bytes.device)] = src.to(self.bytes.device)


class GrpcHandle(TransferHandle):
    def __init__(self, future: grpc.Future, **kw):
        super().__init__(**kw)
        self._future = future

    def _check(self) -> None:
        if not self._future.done():
            return
        try:
            self._future.result()
        except grpc.RpcError as exc:
            code = exc.code()
            self.fail(_ERROR_KINDS.get(code, "error"), f"{code.name}: {exc.details()}")
            return
        except Exception as exc:
            self.fail("error", f"{type(exc).__name__}: {exc}")
            return
        self.succeed()

    def _cancel(self) -> None:
        self._future.cancel()


class _Peer:
    def __init__(self, address: str, layout: KVLayout, sender_name: str, connect, wrap):
        self.address = address
        self.sender_name = sender_name  # how its chunks and notices name it when it sends to us
        self.layout = layout
        self.channel = connect(address, _CHANNEL_OPTIONS)
        self.stub = wrap(pb_grpc.KVTransferStub(self.channel))


def _insecure(address: str, options) -> grpc.Channel:
    return grpc.insecure_channel(address, options=options)


class GrpcTransport(KVTransport):
    backend = "grpc"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        name: str,
        *,
        advertise_address: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        connect=_insecure,
        wrap_stub=lambda stub: stub,
        reserved_only: bool = True,
        **kw,
    ):
        """connect(address, options) -> grpc.Channel and wrap_stub(stub): how calls to peers carry
        the deployment's credential (TLS channel, authorization metadata). reserved_only: refuse
        pushes into blocks not `accept`ed for their transfer id (off only for wire benchmarks)."""
        super().__init__(kv_cache, layout, name, **kw)
        if chunk_bytes < layout.block_bytes:
            raise ValueError(
                f"chunk_bytes: {chunk_bytes} is smaller than one block ({layout.block_bytes} bytes)"
            )
        self.agent_name = agent_name(name)
        self.advertise_address = advertise_address
        self.blocks_per_chunk = chunk_bytes // layout.block_bytes
        self._regions = _RegionBytes(kv_cache, layout)
        self._peers: dict[str, _Peer] = {}
        self._connect, self._wrap_stub = connect, wrap_stub
        self.reserved_only = reserved_only

    def servicer(self, caller_check=None) -> KVTransferServicer:
        """Mount on the worker's gRPC server: pb_grpc.add_KVTransferServicer_to_server(t.servicer(), server).
        caller_check(context, worker_id, method) -> why a call claiming to come from that worker is
        refused (None: accepted)."""
        return KVTransferServicer(self, caller_check)

    def handshake_payload(self) -> bytes:
        return encode_handshake(
            self.layout, self.backend, self.agent_name, grpc_address=self.advertise_address
        )

    def add_peer(self, peer_id: str, payload: bytes, address: str | None = None) -> None:
        msg, remote = decode_handshake(payload, self.layout, self.backend)
        address = address or msg.grpc_address
        if not address:
            raise ValueError("address: the peer advertises no KVTransfer address; pass address=host:port")
        if peer_id in self._peers:
            self.remove_peer(peer_id)
        self._peers[peer_id] = _Peer(address, remote, msg.agent_name, self._connect, self._wrap_stub)
        self._peer_layouts[peer_id] = remote

    def remove_peer(self, peer_id: str) -> None:
        peer = self._peers.pop(peer_id, None)
        self._peer_layouts.pop(peer_id, None)
        if peer is not None:
            self.tracker.fail_sender(peer.sender_name, f"disconnect: peer {peer_id} removed")
            peer.channel.close()  # pending calls on it end as CANCELLED -> their handles error

    def _chunks(self, transfer_id, layers, src, dst):
        step = self.blocks_per_chunk
        pieces = [(layer, i) for layer in layers for i in range(0, len(src), step)]
        for n, (layer, i) in enumerate(pieces):
            chunk = pb.KVBlockChunk(
                layer=layer, dst_block_ids=dst[i : i + step], data=self._regions.read(layer, src[i : i + step]),
                last=n == len(pieces) - 1,
            )  # fmt: skip
            if n == 0:
                chunk.request_id, chunk.sender, chunk.compat_hash = (
                    transfer_id,
                    self.agent_name,
                    self.layout.compat_hash(),
                )
            yield chunk

    def _post(self, peer_id, transfer_id, layers, src, dst, src_regions, dst_regions, timeout):
        peer = self._peers[peer_id]
        future = peer.stub.PushBlocks.future(
            self._chunks(transfer_id, list(layers), src, dst), timeout=timeout
        )
        return GrpcHandle(
            future, backend=self.backend, peer_id=peer_id, request_id=transfer_id,
            nbytes=len(src_regions) * self.layout.block_bytes, timeout=timeout + 1.0,
            on_error=self._on_send_error,
        )  # fmt: skip

    def _notify(self, peer_id: str, notice: pb.KVNotice, timeout: float) -> TransferHandle:
        notice.sender = self.agent_name
        future = self._peers[peer_id].stub.Notify.future(notice, timeout=timeout)
        return GrpcHandle(
            future, backend=self.backend, peer_id=peer_id, request_id=notice.request_id, nbytes=0,
            timeout=timeout + 1.0, on_error=self._on_send_error, counts_bytes=False,
        )  # fmt: skip


class KVTransferServicer(pb_grpc.KVTransferServicer):
    """Receiving end: writes pushed blocks into the transport's tensor (called from server threads)."""

    def __init__(self, transport: GrpcTransport, caller_check=None):
        self._t = transport
        self._caller_check = caller_check

    def PushBlocks(self, request_iterator, context):
        layout = self._t.layout
        sender = transfer_id = ""
        written = regions = 0
        complete = False
        try:
            for chunk in request_iterator:
                if not transfer_id:
                    if not chunk.request_id or not chunk.sender:
                        context.abort(
                            grpc.StatusCode.INVALID_ARGUMENT, "first chunk lacks request_id or sender"
                        )
                    denied = self._caller_check and self._caller_check(
                        context, worker_of(chunk.sender), "PushBlocks"
                    )
                    if denied:
                        TRANSFER_REFUSED.labels(self._t.backend).inc()
                        context.abort(grpc.StatusCode.PERMISSION_DENIED, denied)
                    if chunk.compat_hash != layout.compat_hash():
                        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"KV compatibility hash differs: receiver {layout.compat_hash()}, "
                                      f"sender {chunk.compat_hash or '(none)'}")  # fmt: skip
                    sender, transfer_id = chunk.sender, chunk.request_id
                error = self._check_chunk(chunk, layout)
                if error:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
                if self._t.reserved_only and not self._t.accepts(transfer_id, chunk.dst_block_ids):
                    # checked before writing: the cache stays as it was
                    context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                  f"transfer {transfer_id!r} has not reserved blocks {list(chunk.dst_block_ids)[:8]}")  # fmt: skip
                self._t._regions.write(chunk.layer, list(chunk.dst_block_ids), chunk.data)
                written += len(chunk.data)
                regions += len(chunk.dst_block_ids)
                complete = chunk.last
        except grpc.RpcError:
            # The sender went away mid-stream: the blocks are partly written and will not be completed.
            if transfer_id:
                self._t.tracker.on_failure(sender, transfer_id, "disconnect: sender stream broke")
            raise
        if transfer_id and not complete:
            self._t.tracker.on_failure(sender, transfer_id, "disconnect: sender stream broke")
            context.abort(grpc.StatusCode.ABORTED, "stream ended before its last chunk")
        if transfer_id:
            self._t._received(sender, transfer_id, written)
        return pb.KVPushAck(bytes_written=written, regions_written=regions)

    @staticmethod
    def _check_chunk(chunk: pb.KVBlockChunk, layout: KVLayout) -> str:
        if chunk.layer >= layout.num_layers:
            return f"layer {chunk.layer} out of range [0, {layout.num_layers})"
        bad = [b for b in chunk.dst_block_ids if b >= layout.num_blocks]
        if bad:
            return f"dst_block_ids {bad[:5]} out of range [0, {layout.num_blocks})"
        if len(chunk.data) != len(chunk.dst_block_ids) * layout.block_bytes:
            return f"data has {len(chunk.data)} bytes for {len(chunk.dst_block_ids)} blocks of {layout.block_bytes}"
        return ""

    def Notify(self, request, context):
        if not request.sender or not request.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "notice lacks sender or request_id")
        denied = self._caller_check and self._caller_check(context, worker_of(request.sender), "Notify")
        if denied:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, denied)
        self._t._on_notice(request.sender, request)
        return pb.KVPushAck()
