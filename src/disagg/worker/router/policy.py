"""Routing policy (pure): which worker serves a request, and which prefill workers it may use.

Decode: the least loaded worker, where load counts queued work heavier than running work and a
nearly full KV cache as more load (a full D preempts); a cached prefix on D lowers its cost, since
those tokens need neither prefill nor transfer. Overflow (opt-in): when every decode worker is
busier than an unqueued prefill worker by more than a margin, that worker serves the request whole
(prefill and decode, as a colocated worker would): a pool whose ratio does not fit the request
mix lends its spare prefill capacity to decoding instead of idling while decode streams slow.
Only a request whose prompt costs the lender no more time than the decode steps it takes off the
decode worker is lent: the streams decoding on a lender stall while it computes that prompt.
Prefill: longest cached prefix first (fewer tokens to compute), then the fewest prompt tokens
queued, then the shortest queue. A colocated worker is offered the workers that hold a longer
prefix of its prompt than it does (`rank_holders`): it pulls from one when that is priced cheaper
than computing the prefix itself. The router's own count of requests it has in flight on a worker
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
    decode_step_seconds: float = 0.0  # its recent decode steps; 0 until one ran
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


@dataclass(frozen=True)
class Lending:
    """Overflow (the router's `--prefill-overflow MARGIN`) and the request it would lend.

    `prompt_tokens` and `max_tokens` size the request; 0 where unknown, which skips the check
    that lending it pays."""

    margin: float | None = None  # None: never lend
    prompt_tokens: int = 0
    max_tokens: int = 0


def worth_lending(
    lender: WorkerView, decoder: WorkerView | None, uncached_tokens: int, max_tokens: int
) -> bool:
    """Whether computing the request's prompt on `lender` costs no more than the decode steps it
    would take off `decoder` (one per output token, at the decoder's recent step time).

    The lender computes the whole prompt itself, and every stream decoding there waits for it: a
    long prompt with a short answer (summarisation: 1000 tokens, 3 s on a CPU core, for ~40 steps
    of 50 ms) stalls the lent streams for more than it relieves, and lending those lost a
    prefill-heavy mix 14-16% of colocated goodput. Unmeasured rates, an unknown size or no
    decoder to relieve: lending is judged by the margin alone."""
    if (
        decoder is None
        or lender.prefill_tokens_per_s <= 0
        or decoder.decode_step_seconds <= 0
        or max_tokens <= 0
    ):
        return True
    return uncached_tokens / lender.prefill_tokens_per_s <= max_tokens * decoder.decode_step_seconds


def choose_decode(
    workers: list[WorkerView],
    prefix_match: dict[str, int] | None = None,
    prompt_blocks: int = 0,
    lending: Lending | None = None,
) -> WorkerView | None:
    """The worker to serve a request (decode, or colocated), or None when there is none.

    With a lending margin, a prefill worker with no prompt queued whose cost is lower than the best
    decode worker's by more than the margin serves the request instead, prefilling it itself, if
    that pays (`worth_lending`); so does one when no decode worker is ready."""
    prefix_match = prefix_match or {}
    lending = lending or Lending()
    overflow_margin = lending.margin

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
    if best is not None and cost(lender)[0] + overflow_margin >= cost(best)[0]:
        return best
    hit = prefix_match.get(lender.worker_id, 0) / prompt_blocks if prompt_blocks else 0.0
    uncached = round(lending.prompt_tokens * (1.0 - min(hit, 1.0)))
    if best is not None and not worth_lending(lender, best, uncached, lending.max_tokens):
        return best
    return lender


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


def rank_holders(
    workers: list[WorkerView], chosen: WorkerView, prefix_match: dict[str, int] | None = None, limit: int = 2
) -> list[WorkerView]:
    """For a colocated `chosen` worker: the workers that can prefill (prefill, both) holding a
    longer cached prefix than it does, longest first, then fewest queued prompt tokens."""
    prefix_match = prefix_match or {}
    own = prefix_match.get(chosen.worker_id, 0)
    holders = [
        w for w in workers
        if w.role in ("prefill", "both") and w.worker_id != chosen.worker_id and prefix_match.get(w.worker_id, 0) > own
    ]  # fmt: skip
    holders.sort(
        key=lambda w: (-prefix_match.get(w.worker_id, 0), w.queued_prefill_tokens, w.queue, w.worker_id)
    )
    return holders[:limit]
