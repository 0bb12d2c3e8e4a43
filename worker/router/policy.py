"""Routing policy (pure): which decode worker serves a request, and which prefill workers it may use.

Decode: the least loaded worker, where load counts queued work heavier than running work and a
nearly full KV cache as more load (a full D preempts); a cached prefix on D lowers its cost, since
those tokens need neither prefill nor transfer. Prefill: longest cached prefix first (fewer
tokens to compute), then the fewest prompt tokens queued, then the shortest queue. The router's own count of requests it has in flight
on a worker is fresher than the worker's last heartbeat, so load takes the larger of the two.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    role: str  # "prefill" | "decode" | "both"
    address: str
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    inflight: int = 0  # requests this router has outstanding on the worker
    queued_prefill_tokens: int = 0  # prompt tokens waiting for its prefill steps
    prefill_tokens_per_s: float = 0.0  # its measured prefill rate; 0 until measured
    quantization: str = ""  # the worker's weights (none | int8 | fp8), from its Health

    @property
    def queue(self) -> int:
        return max(self.running + self.waiting, self.inflight)

    @property
    def kv_free_ratio(self) -> float:
        return self.free_blocks / self.total_blocks if self.total_blocks else 1.0


DECODE_ROLES = ("decode", "both")


def served_quantization(views: list[WorkerView]) -> str | None:
    """The weights' quantization the ready workers serve: one name, several joined by "," (a
    rollout changing it), None while no worker has answered."""
    names = sorted({v.quantization for v in views if v.quantization})
    return ",".join(names) if names else None


# Weights of the decode cost: a queued request ~ 2 running ones; an empty KV cache is worth ~4
# requests of headroom; a fully cached prompt ~ 1 request (it saves its whole prefill).
_WAITING_WEIGHT = 2.0
_KV_WEIGHT = 4.0
_PREFIX_WEIGHT = 1.0


def decode_cost(w: WorkerView, cached_blocks: int, prompt_blocks: int) -> float:
    hit = cached_blocks / prompt_blocks if prompt_blocks else 0.0
    queued = max(w.inflight - w.running, w.waiting)
    return w.running + _WAITING_WEIGHT * queued + _KV_WEIGHT * (1.0 - w.kv_free_ratio) - _PREFIX_WEIGHT * hit


def choose_decode(
    workers: list[WorkerView], prefix_match: dict[str, int] | None = None, prompt_blocks: int = 0
) -> WorkerView | None:
    """The decode (or colocated) worker to serve a request, or None when there is none."""
    prefix_match = prefix_match or {}
    candidates = [w for w in workers if w.role in DECODE_ROLES]
    if not candidates:
        return None
    return min(
        candidates,
        key=lambda w: (decode_cost(w, prefix_match.get(w.worker_id, 0), prompt_blocks), w.worker_id),
    )


def rank_prefill(
    workers: list[WorkerView], prefix_match: dict[str, int] | None = None, limit: int = 2
) -> list[WorkerView]:
    """Prefill workers in order of preference: longest cached prefix, then fewest queued prompt
    tokens, then shortest queue."""
    prefix_match = prefix_match or {}
    candidates = [w for w in workers if w.role == "prefill"]
    candidates.sort(
        key=lambda w: (
            -prefix_match.get(w.worker_id, 0), w.queued_prefill_tokens, w.queue, -w.free_blocks, w.worker_id,
        )
    )  # fmt: skip
    return candidates[:limit]
