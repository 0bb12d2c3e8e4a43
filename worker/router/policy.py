"""Routing policy (pure): which worker serves a request, and which prefill workers it may use.

Decode: the least loaded worker, where load counts queued work heavier than running work and a
nearly full KV cache as more load (a full D preempts); a cached prefix on D lowers its cost, since
those tokens need neither prefill nor transfer. Overflow (opt-in): when every decode worker is
busier than an unqueued prefill worker by more than a margin, that worker serves the request whole
(prefill and decode, as a colocated worker would): a pool whose ratio does not fit the request
mix lends its spare prefill capacity to decoding instead of idling while decode streams slow.
Prefill: longest cached prefix first (fewer tokens to compute), then the fewest prompt tokens
queued, then the shortest queue. The router's own count of requests it has in flight on a worker
is fresher than the worker's last heartbeat, so load takes the larger of the two.
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
WAITING_WEIGHT = 2.0
_KV_WEIGHT = 4.0
_PREFIX_WEIGHT = 1.0


def decode_cost(w: WorkerView, cached_blocks: int, prompt_blocks: int) -> float:
    hit = cached_blocks / prompt_blocks if prompt_blocks else 0.0
    queued = max(w.inflight - w.running, w.waiting)
    return w.running + WAITING_WEIGHT * queued + _KV_WEIGHT * (1.0 - w.kv_free_ratio) - _PREFIX_WEIGHT * hit


def choose_decode(
    workers: list[WorkerView],
    prefix_match: dict[str, int] | None = None,
    prompt_blocks: int = 0,
    overflow_margin: float | None = None,
) -> WorkerView | None:
    """The worker to serve a request (decode, or colocated), or None when there is none.

    With `overflow_margin` set, a prefill worker with no prompt queued whose cost is lower than
    the best decode worker's by more than the margin serves the request instead, prefilling it
    itself; so does one when no decode worker is ready."""
    prefix_match = prefix_match or {}

    def cost(w: WorkerView) -> tuple[float, str]:
        return decode_cost(w, prefix_match.get(w.worker_id, 0), prompt_blocks), w.worker_id

    decoders = [w for w in workers if w.role in DECODE_ROLES]
    best = min(decoders, key=cost) if decoders else None
    if overflow_margin is None:
        return best
    # only a prefill worker with no prompt to prefill is lent: a lent stream's tokens would wait
    # behind every prompt chunk it computes (long prompts: a second per chunk on a CPU core)
    spare = [w for w in workers if w.role == "prefill" and not w.queued_prefill_tokens and not w.waiting]
    if not spare:
        return best
    lender = min(spare, key=cost)
    if best is None or cost(lender)[0] + overflow_margin < cost(best)[0]:
        return lender
    return best


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
