"""The handshake payload: encoded by the receiver, checked and decoded by the sender.

Carried as opaque bytes by the worker's Handshake RPC; the schema is `KVHandshake` in
proto/kv_transfer.proto.
"""

from __future__ import annotations

import uuid

from google.protobuf.message import DecodeError

from disagg.proto import kv_transfer_pb2 as pb
from disagg.worker.kv_transfer.errors import IncompatiblePeer
from disagg.worker.kv_transfer.layout import PROTOCOL_VERSION, KVLayout

_COMPAT_FIELDS = (
    "model_id", "dtype", "kv_cache_dtype", "weight_quantization", "num_layers", "num_kv_heads", "head_dim",
    "block_size",
)  # fmt: skip


def agent_name(worker_id: str) -> str:
    """A transport's name on the wire: its worker's id, and a fresh suffix per process so that a
    restarted worker is not confused with its old self."""
    return f"{worker_id}-{uuid.uuid4().hex[:8]}"


def worker_of(name: str) -> str:
    """The worker id an `agent_name` was made from."""
    return name.rsplit("-", 1)[0]


def layout_to_proto(layout: KVLayout) -> pb.KVLayoutSpec:
    return pb.KVLayoutSpec(
        model_id=layout.model_id,
        dtype=layout.dtype,
        num_layers=layout.num_layers,
        num_blocks=layout.num_blocks,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        tp_size=layout.tp_size,
        model_kv_heads=layout.model_kv_heads,
        kv_cache_dtype=layout.kv_cache_dtype,
        weight_quantization=layout.weight_quantization,
    )


def layout_from_proto(spec: pb.KVLayoutSpec) -> KVLayout:
    return KVLayout(
        model_id=spec.model_id,
        dtype=spec.dtype,
        num_layers=spec.num_layers,
        num_blocks=spec.num_blocks,
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        tp_size=spec.tp_size or 1,
        model_kv_heads=spec.model_kv_heads or None,
        kv_cache_dtype=spec.kv_cache_dtype,
        weight_quantization=spec.weight_quantization,
    )


def encode_handshake(layout: KVLayout, backend: str, agent_name: str, **fields) -> bytes:
    msg = pb.KVHandshake(
        protocol_version=PROTOCOL_VERSION,
        compat_hash=layout.compat_hash(),
        layout=layout_to_proto(layout),
        backend=backend,
        agent_name=agent_name,
        **fields,
    )
    return msg.SerializeToString()


def parse_handshake(payload: bytes) -> pb.KVHandshake:
    if not isinstance(payload, bytes | bytearray) or not payload:
        raise ValueError("payload: expected the non-empty bytes of a peer's handshake_payload()")
    msg = pb.KVHandshake()
    try:
        msg.ParseFromString(bytes(payload))
    except DecodeError as exc:
        raise ValueError(f"payload: not a KV handshake ({exc})") from exc
    return msg


def decode_handshake(
    payload: bytes, local: KVLayout, backend: str, cross_tp: bool = False
) -> tuple[pb.KVHandshake, KVLayout]:
    """Parse a peer's payload; raise IncompatiblePeer saying exactly what differs. `cross_tp`:
    the caller moves heads between ranks, so the peer may split the model's KV heads differently
    (the model, dtype, layers, head size and block size must still match)."""
    msg = parse_handshake(payload)
    if msg.protocol_version != PROTOCOL_VERSION:
        raise IncompatiblePeer(
            f"KV protocol version differs: local {PROTOCOL_VERSION}, peer {msg.protocol_version}"
        )
    if msg.backend != backend:
        raise IncompatiblePeer(f"KV transport differs: local {backend!r}, peer {msg.backend!r}")
    if not msg.agent_name:
        raise ValueError("payload: agent_name is empty")
    try:
        remote = layout_from_proto(msg.layout)
    except ValueError as exc:
        raise ValueError(f"payload: bad layout ({exc})") from exc
    if cross_tp:
        if local.model_kv_heads != remote.model_kv_heads:
            raise IncompatiblePeer(
                f"KV layouts differ in the model's KV heads: local {local.model_kv_heads}, "
                f"peer {remote.model_kv_heads}"
            )
    elif local.tp_key != remote.tp_key:
        raise IncompatiblePeer(
            f"tensor-parallel layouts differ: local {_tp_text(local)}, peer {_tp_text(remote)}; this "
            f"{backend} transport moves KV only between workers split the same way"
        )
    for field in _COMPAT_FIELDS:
        if cross_tp and field == "num_kv_heads":
            continue
        mine, theirs = getattr(local, field), getattr(remote, field)
        if mine != theirs:
            raise IncompatiblePeer(f"KV layouts differ in {field}: local {mine!r}, peer {theirs!r}")
    if cross_tp:
        if msg.compat_hash != remote.compat_hash():
            raise ValueError("payload: compat_hash does not match its layout")
    elif msg.compat_hash != local.compat_hash():
        raise IncompatiblePeer(
            f"KV compatibility hash differs: local {local.compat_hash()}, peer {msg.compat_hash}"
        )
    return msg, remote


def _tp_text(layout: KVLayout) -> str:
    return f"TP={layout.tp_size} ({layout.num_kv_heads} of {layout.model_kv_heads} KV heads per rank)"
