"""The worker's link to Redis (disagg.worker.kv_state): registry heartbeats, transfer records,
prefix index publishing, reclaims and reaping.

Redis calls are synchronous, so they run on one dedicated thread (ordered, and never on the
asyncio loop or the engine thread). Serving never waits on Redis being up: when it is down,
transfer records are skipped (generation 0), publishes are kept and replayed after it returns,
and `available` says so.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable

log = logging.getLogger("disagg.worker.state")

_CALL_TIMEOUT = 2.0
_MAX_PUBLISHED = 200_000  # bound on hashes remembered for republishing after a Redis restart


class StateLink:
    def __init__(self, kv_state, worker_info, heartbeat_seconds: float = 1.0, reap_seconds: float = 2.0):
        """kv_state: a disagg.worker.kv_state.KVState, or None to run without Redis."""
        self.kv = kv_state
        self.info = worker_info
        self.heartbeat_seconds = heartbeat_seconds
        self.reap_seconds = reap_seconds
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="redis")
        self._pending: collections.deque[tuple[bool, list[int]]] = collections.deque()  # (add, hashes)
        self._published: dict[int, None] = {}  # insertion-ordered set, for republish
        self._lock = threading.Lock()
        self._task: asyncio.Task | None = None
        self.available = kv_state is not None
        self._warned = False
        self.registered = False

    # ---- availability ---------------------------------------------------------------------------
    def _ok(self) -> None:
        if not self.available or self._warned:
            log.info("Redis reachable")
        self.available = True
        self._warned = False

    def _down(self, e: BaseException | str) -> None:
        self.available = False
        if not self._warned:
            log.warning("Redis unavailable (%s): serving continues without registry/prefix index", e)
            self._warned = True

    async def _run(self, fn: Callable, *args, default=None):
        """Run a KVState call on the Redis thread. An outage (or a hung call) returns `default`;
        protocol errors (StaleGeneration, TransferGone, ...) reach the caller."""
        if self.kv is None:
            return default
        from disagg.worker.kv_state import RedisUnavailable

        loop = asyncio.get_running_loop()
        try:
            result = await asyncio.wait_for(
                loop.run_in_executor(self._pool, fn, *args), timeout=_CALL_TIMEOUT
            )
        except (RedisUnavailable, TimeoutError) as e:
            self._down(e)
            return default
        self._ok()
        return result

    # ---- registry ---------------------------------------------------------------------------------
    def _register(self) -> None:
        self.kv.register(self.info)
        self.registered = True

    def _heartbeat(self, load: dict) -> None:
        from disagg.worker.kv_state import WorkerLoad

        if not self.registered:
            self._register()
        result = self.kv.heartbeat(
            WorkerLoad(
                running=load.get("running", 0),
                waiting=load.get("waiting", 0),
                free_blocks=load.get("free_blocks", 0),
                total_blocks=load.get("total_blocks", 0),
            )
        )
        if result.reregistered:
            # our registry entry vanished (Redis restarted, or the TTL ran out): restore the
            # prefix index entries of the blocks we hold
            with self._lock:
                hashes = list(self._published)
            self.kv.republish(hashes)
            log.info("re-registered; republished %d block hashes", len(hashes))

    def _flush_publishes(self) -> None:
        while self._pending:
            add, hashes = self._pending[0]
            (self.kv.publish_blocks if add else self.kv.unpublish_blocks)(hashes)
            self._pending.popleft()

    async def register(self) -> None:
        await self._run(self._register)

    async def deregister(self) -> None:
        """Leave the registry for good. The upkeep stops first: a heartbeat after the delete would
        find the entry gone and write it back, leaving a stopped worker listed until its TTL."""
        await self._stop_upkeep()
        if self.kv is not None and self.registered:
            await self._run(self.kv.deregister)  # after any heartbeat already on the Redis thread

    def publish(self, hashes: list[int]) -> None:
        """Thread-safe: called from the engine thread when a prompt's blocks enter the cache."""
        with self._lock:
            new = [h for h in hashes if h not in self._published]
            for h in new:
                self._published[h] = None
            while len(self._published) > _MAX_PUBLISHED:
                self._published.pop(next(iter(self._published)))
        if new:
            self._pending.append((True, new))

    def published(self) -> list[int]:
        with self._lock:
            return list(self._published)

    def unpublish(self, hashes: list[int]) -> None:
        """Blocks this worker evicted: take them out of the index (thread-safe)."""
        with self._lock:
            for h in hashes:
                self._published.pop(h, None)
        if hashes:
            self._pending.append((False, list(hashes)))

    # ---- transfers --------------------------------------------------------------------------------
    async def begin_transfer(
        self, request_id: str, prefill_owner: str, dst_blocks: list[int], lease: float, previous: int = 0
    ) -> int:
        """The record's generation for this attempt (0 when Redis is unavailable). A retry
        (`previous` set) reassigns the record, so the first prefill worker's writes are refused."""
        from disagg.worker.kv_state import StaleGeneration, TransferExists

        def begin():
            if previous:
                # StaleGeneration: the record is gone (reaped, or Redis restarted); start a new one below
                with contextlib.suppress(StaleGeneration):
                    return self.kv.reassign(request_id, previous, prefill_owner, lease_seconds=lease)
            try:
                return self.kv.begin_transfer(
                    request_id,
                    prefill_owner=prefill_owner,
                    decode_owner=self.info.id,
                    dst_blocks=list(dst_blocks),
                    lease_seconds=lease,
                )
            except TransferExists:
                record = self.kv.get_transfer(request_id)
                gen = record.generation if record else 0
                return self.kv.reassign(request_id, gen, prefill_owner, lease_seconds=lease)

        return await self._run(begin, default=0)

    async def renew_transfer(self, request_id: str, generation: int, lease: float) -> None:
        if generation:
            await self._quiet(lambda: self.kv.renew(request_id, generation, lease_seconds=lease))

    async def finish_transfer(self, request_id: str, generation: int) -> None:
        if generation:
            await self._quiet(lambda: self.kv.finish(request_id, generation))

    async def _quiet(self, fn) -> None:
        """A fenced call whose refusal only means someone else settled the record first."""
        from disagg.worker.kv_state import KVStateError

        try:
            await self._run(fn)
        except KVStateError as e:
            log.debug("transfer record: %s", e)

    async def generation_current(self, request_id: str, generation: int) -> bool:
        """False only when Redis positively says the record moved to another generation (a record
        that is gone may just be a Redis restart: the prefill goes ahead)."""
        from disagg.worker.kv_state import StaleGeneration, TransferGone

        if not generation:
            return True
        try:
            await self._run(lambda: self.kv.ensure_generation(request_id, generation))
        except TransferGone:
            return True
        except StaleGeneration:
            return False
        return True

    # ---- background upkeep --------------------------------------------------------------------------
    def start(
        self,
        load: Callable[[], dict],
        reclaim: Callable[[str], None],
        evicted: Callable[[list[int]], Awaitable[list[int]]] | None = None,
    ) -> None:
        """load(): current accounting; reclaim(request_id): free what a reaped transfer held;
        evicted(hashes): which of the published hashes are no longer in the prefix cache."""
        if self.kv is not None:
            self._task = asyncio.create_task(self._keep(load, reclaim, evicted))

    async def _keep(self, load, reclaim, evicted) -> None:
        since_reap = 0.0
        while True:
            try:
                await self._run(self._heartbeat, load())
                await self._run(self._flush_publishes)
                for item in await self._run(self.kv.drain_reclaims, default=[]) or []:
                    log.info("reclaiming %s (%s)", item.request_id, item.reason)
                    reclaim(item.request_id)
                since_reap += self.heartbeat_seconds
                if since_reap >= self.reap_seconds:
                    since_reap = 0.0
                    await self._run(self.kv.reap)
                    if evicted is not None:
                        self.unpublish(await evicted(self.published()))
            except Exception:  # upkeep must outlive any single failure
                log.exception("Redis upkeep failed")
            await asyncio.sleep(self.heartbeat_seconds)

    async def _stop_upkeep(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def stop(self) -> None:
        await self._stop_upkeep()
        self._pool.shutdown(wait=False, cancel_futures=True)
