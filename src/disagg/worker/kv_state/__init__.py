"""Shared KV state of a deployment in Redis: worker registry, in-flight transfer records with
leases and generation fencing, the prefix index, and the reaper. See state.KVState."""

from disagg.worker.kv_state.errors import (
    KVStateError,
    RedisUnavailable,
    StaleGeneration,
    TransferExists,
    TransferGone,
)
from disagg.worker.kv_state.records import (
    HeartbeatResult,
    ReapReport,
    Reclaim,
    TransferRecord,
    WorkerInfo,
    WorkerLoad,
)
from disagg.worker.kv_state.state import KVState

__all__ = [
    "HeartbeatResult", "KVState", "KVStateError", "ReapReport", "Reclaim",
    "RedisUnavailable", "StaleGeneration", "TransferExists", "TransferGone", "TransferRecord", "WorkerInfo",
    "WorkerLoad",
]  # fmt: skip
