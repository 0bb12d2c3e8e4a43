"""Prometheus families of KV transfer (default registry, next to the serving metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

TRANSFER_BYTES = Counter(
    "disagg_kv_transfer_bytes",
    "KV cache bytes moved between workers.",
    ["backend", "direction"],
)
TRANSFER_SECONDS = Histogram(
    "disagg_kv_transfer_seconds",
    "Duration of one KV send, from posting to the sender seeing it complete.",
    ["backend"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
TRANSFER_FAILURES = Counter(
    "disagg_kv_transfer_failures",
    "KV sends or receives that failed, by reason (disconnect, timeout, rejected, aborted, stalled, error).",
    ["backend", "reason"],
)
TRANSFER_REFUSED = Counter(
    "disagg_kv_transfer_refused",
    "Incoming KV writes refused: their transfer id had not reserved the target blocks (or none).",
    ["backend"],
)
