"""What KVState stores, as plain data with its Redis encoding."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import NamedTuple

ROLES = ("prefill", "decode", "both")


def lease_ms(lease_seconds: float) -> int:
    if not isinstance(lease_seconds, int | float) or lease_seconds <= 0:
        raise ValueError(f"lease_seconds: must be a positive number, got {lease_seconds!r}")
    return max(1, round(lease_seconds * 1000))


def block_list(field_name: str, blocks) -> list[int]:
    try:
        out = [int(b) for b in blocks]
    except (TypeError, ValueError):
        raise ValueError(f"{field_name}: expected a list of block ids, got {blocks!r}") from None
    if any(b < 0 for b in out):
        raise ValueError(f"{field_name}: block ids must be >= 0")
    return out


@dataclass
class WorkerLoad:
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0

    def to_fields(self) -> dict[str, int]:
        return {"running": self.running, "waiting": self.waiting,
                "free_blocks": self.free_blocks, "total_blocks": self.total_blocks}  # fmt: skip


@dataclass
class WorkerInfo:
    id: str
    role: str
    address: str
    metrics_url: str = ""
    model: str = ""
    load: WorkerLoad = field(default_factory=WorkerLoad)
    heartbeat_at: float = 0.0  # seconds since the epoch, Redis clock

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.address:
            raise ValueError("address: a worker must have its gRPC address (host:port)")

    def to_fields(self) -> dict[str, str | int]:
        return {"id": self.id, "role": self.role, "address": self.address, "metrics_url": self.metrics_url,
                "model": self.model, **self.load.to_fields()}  # fmt: skip

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> WorkerInfo:
        load = WorkerLoad(
            **{k: int(fields.get(k, 0)) for k in ("running", "waiting", "free_blocks", "total_blocks")}
        )
        return cls(
            id=fields["id"], role=fields["role"], address=fields["address"],
            metrics_url=fields.get("metrics_url", ""), model=fields.get("model", ""), load=load,
            heartbeat_at=int(fields.get("heartbeat_ms", 0)) / 1000,
        )  # fmt: skip


@dataclass
class TransferRecord:
    """A remote prefill in flight: the decode worker's blocks it writes, leased. The record is
    a lease and a fence, not a progress report: while its lease lives the reaper leaves the
    blocks alone; each attempt (a new prefill owner) takes a new generation, so a prefill worker
    acting on an older attempt is refused. Its progress lives on the two workers."""

    request_id: str
    prefill_owner: str
    decode_owner: str
    dst_blocks: list[int]
    generation: int
    lease_expiry: float  # seconds since the epoch, Redis clock

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> TransferRecord:
        return cls(
            request_id=fields["request_id"], prefill_owner=fields["prefill_owner"],
            decode_owner=fields["decode_owner"], dst_blocks=json.loads(fields["dst_blocks"]),
            generation=int(fields["generation"]), lease_expiry=int(fields["lease_expiry_ms"]) / 1000,
        )  # fmt: skip


class Reclaim(NamedTuple):
    """Blocks a worker must free because a transfer it took part in was abandoned.

    Free through your own request -> blocks map: a request already released locally is a no-op,
    which makes a reclaim that races with a late local release harmless."""

    request_id: str
    blocks: list[int]
    generation: int
    reason: str

    @classmethod
    def decode(cls, raw: bytes | str) -> Reclaim:
        d = json.loads(raw)
        return cls(d["request_id"], [int(b) for b in d["blocks"]], int(d["generation"]), d["reason"])


@dataclass
class ReapReport:
    expired_transfers: list[str] = field(default_factory=list)
    reclaims_queued: int = 0
    dead_workers: list[str] = field(default_factory=list)
    index_entries_removed: int = 0


@dataclass
class HeartbeatResult:
    """reregistered: the registry entry was gone (expired or Redis restarted) and was written again;
    the worker should call `republish` with the hashes it holds."""

    reregistered: bool
