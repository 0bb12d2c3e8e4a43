"""Placement: the decode worker a generation runs on and the prefill workers it is offered, from
the pool's views of the workers and the Redis prefix index (the pure ranking is `policy.py`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

from disagg.proto import worker_pb2
from disagg.worker.router.args import RouterArgs
from disagg.worker.router.policy import Lending, WorkerView, choose_decode, rank_holders, rank_prefill
from disagg.worker.router.workers import WorkerPool
from disagg.worker.serving.attempt import MAX_ATTEMPTS
from disagg.worker.serving.metrics import ServingMetrics

log = logging.getLogger("disagg.router")

# The prefill candidates a decode worker tries (serving/attempt.py): offering more would go unused.
PREFILL_CANDIDATES = MAX_ATTEMPTS


class Placement:
    def __init__(
        self,
        args: RouterArgs,
        pool: WorkerPool,
        prefix_lookup: Callable[[list[int]], dict[str, int]] | None,
        metrics: ServingMetrics,
    ):
        self.args = args
        self.pool = pool
        self.prefix_lookup = prefix_lookup
        self.metrics = metrics
        self._prefix_warned = False

    async def prefix_match(self, hashes: list[int]) -> dict[str, int]:
        """Worker id -> how many of the prompt's leading blocks it holds; {} while Redis is down
        (counted, and logged once per outage): routing goes on without prefix awareness."""
        if not hashes or self.prefix_lookup is None:
            return {}
        try:
            match = await asyncio.wait_for(asyncio.to_thread(self.prefix_lookup, hashes), timeout=0.5)
        except Exception as e:
            self.metrics.prefix_routing_unavailable.inc()
            if not self._prefix_warned:
                log.warning("prefix index unavailable (%s): routing without prefix awareness", e)
                self._prefix_warned = True
            return {}
        if self._prefix_warned:
            log.info("prefix index available again")
            self._prefix_warned = False
        best = max(match.values(), default=0)
        self.metrics.prefix_lookup(len(hashes), best)
        return match

    def lending(self, prompt_tokens: int, max_tokens: int) -> Lending:
        return Lending(self.args.prefill_overflow, prompt_tokens, max_tokens)

    def choose(
        self, match: dict[str, int], prompt_blocks: int, lend: Lending, taken: Collection[str] = ()
    ) -> tuple[list[WorkerView], WorkerView | None]:
        """The ready workers other than `taken` (ids), and the decode worker among them (or None)."""
        views = [v for v in self.pool.views() if v.worker_id not in taken]
        return views, choose_decode(views, match, prompt_blocks, lend)

    async def choose_or_wait(
        self, match: dict[str, int], prompt_blocks: int, lend: Lending, taken: Collection[str] = ()
    ) -> tuple[list[WorkerView], WorkerView | None]:
        """`choose`, once more after the pool's next poll when no worker fits now: a worker leaves
        rotation for a poll or two (restarting, one failed poll), which is no reason for a 503."""
        views, decode = self.choose(match, prompt_blocks, lend, taken)
        if decode is None:
            await self.pool.next_refresh(timeout=2 * self.pool.refresh_seconds + 1)
            views, decode = self.choose(match, prompt_blocks, lend, taken)
        return views, decode

    def prefill_targets(
        self, views: list[WorkerView], decode: WorkerView, match: dict[str, int]
    ) -> list[worker_pb2.PrefillTarget]:
        """The prefill targets `decode` is offered, with what it prices them by."""
        return [
            worker_pb2.PrefillTarget(
                worker_id=w.worker_id,
                address=w.address,
                queued_prefill_tokens=w.queued_prefill_tokens,
                prefill_tokens_per_s=w.prefill_tokens_per_s,
                cached_tokens=match.get(w.worker_id, 0) * self.args.block_size,
            )  # fmt: skip
            for w in self._prefill_candidates(views, decode, match)
        ]

    @staticmethod
    def _prefill_candidates(views: list[WorkerView], decode: WorkerView, match: dict[str, int]):
        """Where `decode` may have its prompt prefilled: the prefill workers for a decode worker;
        for a colocated one, the workers holding a longer prefix of it (a pull it prices); none for
        a lent prefill worker, which prefills itself."""
        if decode.role == "decode":
            return rank_prefill(views, match, PREFILL_CANDIDATES)
        if decode.role == "both":
            return rank_holders(views, decode, match, PREFILL_CANDIDATES)
        return []
