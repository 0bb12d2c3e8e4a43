"""KVState: one worker's view of the deployment's shared state in Redis.

Registry (heartbeat with TTL), in-flight transfer records (leases, generation fencing), the
prefix index (block hash -> workers) and the reaper. Every method either succeeds, raises a
KVStateError subclass, or raises RedisUnavailable while Redis is down (then `available` is
False); callers keep serving without the index. Methods are safe to call from several threads.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable

from disagg.worker.kv_state import scripts
from disagg.worker.kv_state.errors import StaleGeneration, TransferExists, TransferGone
from disagg.worker.kv_state.keys import Keys, check_name, hash_key
from disagg.worker.kv_state.link import RedisLink
from disagg.worker.kv_state.prefix import PrefixMatcher
from disagg.worker.kv_state.records import (
    HeartbeatResult,
    ReapReport,
    Reclaim,
    TransferRecord,
    WorkerInfo,
    WorkerLoad,
    block_list,
    lease_ms,
)

log = logging.getLogger(__name__)

RECLAIM_TTL_MS = 24 * 3600 * 1000  # a reclaim list of a worker that never comes back expires
_MATCH_CHUNK = 64  # block hashes looked up per round trip in match_prefix
_REAP_BATCH = 256
_PUBLISH_CHUNK = 1000


def _now_arg(now: float | None) -> int:
    return -1 if now is None else round(now * 1000)


class KVState:
    def __init__(
        self,
        redis_url: str,
        deployment: str,
        worker_id: str,
        *,
        heartbeat_ttl: float = 10.0,
        timeout: float = 1.0,
        on_reregister: Callable[[], None] | None = None,
        password: str | None = None,
    ):
        """password: Redis AUTH, kept apart from the URL (which may be logged).

        on_reregister: called (from the heartbeating thread) after the registry entry had to
        be written again, e.g. after a Redis restart; republish the cached block hashes there."""
        self.keys = Keys(deployment)
        self.worker_id = check_name("worker_id", worker_id)
        self.heartbeat_ttl_ms = lease_ms(heartbeat_ttl)
        self.link = RedisLink(redis_url, timeout, password=password)
        self.on_reregister = on_reregister
        self._info: WorkerInfo | None = None
        client = self.link.client
        self._s = {name: client.register_script(getattr(scripts, name)) for name in (
            "HEARTBEAT", "REGISTER", "BEGIN_TRANSFER", "RENEW_TRANSFER", "REASSIGN", "FINISH_TRANSFER",
            "REAP_TRANSFER", "DROP_WORKER_INDEX", "DRAIN",
        )}  # fmt: skip

    @property
    def available(self) -> bool:
        return self.link.available

    def ping(self) -> bool:
        """True if Redis answers now (also refreshes `available`)."""
        try:
            return bool(self.link.run("ping", lambda c: c.ping()))
        except Exception:
            return False

    def close(self) -> None:
        self.link.close()

    # ---- registry ----------------------------------------------------------------------------
    def register(self, info: WorkerInfo, now: float | None = None) -> None:
        """Announce this worker. The first call of a process also clears what a previous process
        with the same id left behind (its reclaim list and published hashes): nothing is held yet."""
        if info.id != self.worker_id:
            raise ValueError(f"info.id: {info.id!r} is not this KVState's worker_id {self.worker_id!r}")
        fresh = self._info is None
        self._info = info
        if fresh:
            self.link.run("register", lambda c: c.delete(self.keys.reclaims(self.worker_id)))
            self._clear_own_index()
        self._write_registration(now)

    def _write_registration(self, now: float | None) -> None:
        pairs = [str(x) for kv in self._info.to_fields().items() for x in kv]
        self.link.run("register", lambda c: self._s["REGISTER"](
            keys=[self.keys.worker(self.worker_id), self.keys.workers],
            args=[self.heartbeat_ttl_ms, _now_arg(now), self.worker_id, *pairs], client=c,
        ))  # fmt: skip

    def heartbeat(self, load: WorkerLoad, now: float | None = None) -> HeartbeatResult:
        """Refresh the TTL and load. If the entry is gone (expired, reaped, Redis restarted), write
        it again and report reregistered=True (and call on_reregister)."""
        if self._info is None:
            raise RuntimeError("heartbeat before register")
        self._info.load = load
        found = self.link.run("heartbeat", lambda c: self._s["HEARTBEAT"](
            keys=[self.keys.worker(self.worker_id), self.keys.workers],
            args=[self.heartbeat_ttl_ms, _now_arg(now), self.worker_id, load.running, load.waiting,
                  load.free_blocks, load.total_blocks], client=c,
        ))  # fmt: skip
        if found:
            return HeartbeatResult(reregistered=False)
        log.warning("worker %s missing from the Redis registry; registering again", self.worker_id)
        self._write_registration(now)
        if self.on_reregister is not None:
            self.on_reregister()
        return HeartbeatResult(reregistered=True)

    def deregister(self) -> None:
        """Leave cleanly: registry entry and published hashes go now rather than at TTL expiry."""
        self.link.run("deregister", lambda c: c.delete(self.keys.worker(self.worker_id)))
        self._clear_own_index()

    def workers(self, role: str | None = None) -> list[WorkerInfo]:
        """Live workers (entries whose TTL has not run out), optionally of one role."""

        def read(c):
            ids = sorted(c.smembers(self.keys.workers))
            pipe = c.pipeline(transaction=False)
            for wid in ids:
                pipe.hgetall(self.keys.worker(wid))
            return pipe.execute()

        out = []
        for fields in self.link.run("workers", read):
            if not fields:
                continue
            info = WorkerInfo.from_fields(fields)
            if role is None or info.role == role or (info.role == "both" and role in ("prefill", "decode")):
                out.append(info)
        return out

    # ---- transfer records --------------------------------------------------------------------
    def begin_transfer(
        self,
        request_id: str,
        prefill_owner: str,
        decode_owner: str,
        dst_blocks: Iterable[int],
        lease_seconds: float,
        now: float | None = None,
    ) -> int:
        """Create the record of a transfer into `dst_blocks`; return its generation (fencing token)."""
        if not request_id:
            raise ValueError("request_id: must be non-empty")
        check_name("decode_owner", decode_owner)
        if prefill_owner:
            check_name("prefill_owner", prefill_owner)
        dst = block_list("dst_blocks", dst_blocks)
        gen, _ = self.link.run("begin_transfer", lambda c: self._s["BEGIN_TRANSFER"](
            keys=[self.keys.transfer(request_id), self.keys.leases, self.keys.generation],
            args=[request_id, prefill_owner, decode_owner, json.dumps(dst), lease_ms(lease_seconds),
                  _now_arg(now)], client=c,
        ))  # fmt: skip
        if gen < 0:
            raise TransferExists(f"transfer {request_id!r} is already in flight")
        return int(gen)

    def renew(
        self, request_id: str, generation: int, lease_seconds: float, now: float | None = None
    ) -> float:
        """Fenced lease renewal; returns the new expiry (epoch seconds). Raises StaleGeneration /
        TransferGone."""
        status, value = self.link.run("renew_transfer", lambda c: self._s["RENEW_TRANSFER"](
            keys=[self.keys.transfer(request_id), self.keys.leases],
            args=[int(generation), lease_ms(lease_seconds), _now_arg(now), request_id], client=c,
        ))  # fmt: skip
        self._raise_for(status, value, request_id, generation)
        return int(value) / 1000

    def reassign(
        self,
        request_id: str,
        generation: int,
        prefill_owner: str,
        lease_seconds: float = 30.0,
        now: float | None = None,
    ) -> int:
        """Hand the transfer to another prefill worker: returns the new generation (the old
        owner's Prefill is refused from now on)."""
        check_name("prefill_owner", prefill_owner)
        status, value = self.link.run("reassign", lambda c: self._s["REASSIGN"](
            keys=[self.keys.transfer(request_id), self.keys.leases, self.keys.generation],
            args=[int(generation), prefill_owner, lease_ms(lease_seconds), _now_arg(now), request_id], client=c,
        ))  # fmt: skip
        self._raise_for(status, value, request_id, generation)
        return int(value)

    def finish(self, request_id: str, generation: int) -> None:
        """Delete the record (both sides released their blocks). Raises StaleGeneration or
        TransferGone if someone else already settled it (e.g. the reaper: its reclaims are queued)."""
        status = self.link.run("finish_transfer", lambda c: self._s["FINISH_TRANSFER"](
            keys=[self.keys.transfer(request_id), self.keys.leases], args=[int(generation), request_id], client=c,
        ))  # fmt: skip
        self._raise_for(status, None, request_id, generation)

    def ensure_generation(self, request_id: str, generation: int) -> None:
        """Raise unless `generation` is the record's current one (call before touching blocks)."""
        current = self.link.run("ensure_generation",
                                lambda c: c.hget(self.keys.transfer(request_id), "generation"))  # fmt: skip
        self._raise_for("gone" if current is None else "ok" if int(current) == int(generation) else "stale",
                        current, request_id, generation)  # fmt: skip

    def get_transfer(self, request_id: str) -> TransferRecord | None:
        fields = self.link.run("get_transfer", lambda c: c.hgetall(self.keys.transfer(request_id)))
        return TransferRecord.from_fields(fields) if fields else None

    @staticmethod
    def _raise_for(status, value, request_id, generation) -> None:
        if status == "ok":
            return
        if status == "gone":
            raise TransferGone(f"transfer {request_id!r} no longer exists (finished or reaped)")
        if status == "stale":
            raise StaleGeneration(
                f"transfer {request_id!r}: generation {generation} is stale (current {value})"
            )
        raise RuntimeError(f"unexpected script result {status!r}")

    # ---- reclaims ----------------------------------------------------------------------------
    def drain_reclaims(self) -> list[Reclaim]:
        """Blocks of abandoned transfers this worker must free; each entry is returned once."""
        raw = self.link.run("drain_reclaims", lambda c: self._s["DRAIN"](
            keys=[self.keys.reclaims(self.worker_id)], client=c))  # fmt: skip
        return [Reclaim.decode(item) for item in raw]

    # ---- prefix index ------------------------------------------------------------------------
    def publish_blocks(self, block_hashes: Iterable[int | str]) -> None:
        hashes = [hash_key(h) for h in block_hashes]
        self._index_write("publish_blocks", hashes, add=True)

    def unpublish_blocks(self, block_hashes: Iterable[int | str]) -> None:
        hashes = [hash_key(h) for h in block_hashes]
        self._index_write("unpublish_blocks", hashes, add=False)

    def republish(self, block_hashes: Iterable[int | str]) -> None:
        """Make the index say exactly that this worker holds these blocks (after a Redis restart)."""
        hashes = [hash_key(h) for h in block_hashes]
        self._clear_own_index()
        self._index_write("republish", hashes, add=True)

    def _index_write(self, what: str, hashes: list[str], add: bool) -> None:
        if not hashes:
            return
        own = self.keys.worker_blocks(self.worker_id)

        def write(c):
            pipe = c.pipeline(transaction=False)
            for i in range(0, len(hashes), _PUBLISH_CHUNK):
                chunk = hashes[i : i + _PUBLISH_CHUNK]
                for h in chunk:
                    (pipe.sadd if add else pipe.srem)(self.keys.block_prefix + h, self.worker_id)
                (pipe.sadd if add else pipe.srem)(own, *chunk)
            pipe.execute()

        self.link.run(what, write)

    def _clear_own_index(self) -> None:
        own = self.keys.worker_blocks(self.worker_id)

        def clear(c):
            hashes = c.smembers(own)
            pipe = c.pipeline(transaction=False)
            for h in hashes:
                pipe.srem(self.keys.block_prefix + h, self.worker_id)
            pipe.delete(own)
            pipe.execute()

        self.link.run("clear_index", clear)

    def match_prefix(self, block_hashes: Iterable[int | str]) -> dict[str, int]:
        """{worker_id: number of leading blocks of this prompt it holds}, live workers only."""
        hashes = [hash_key(h) for h in block_hashes]

        def match(c):
            matcher = PrefixMatcher()
            for i in range(0, len(hashes), _MATCH_CHUNK):
                pipe = c.pipeline(transaction=False)
                for h in hashes[i : i + _MATCH_CHUNK]:
                    pipe.smembers(self.keys.block_prefix + h)
                matcher.feed(pipe.execute())
                if matcher.exhausted:
                    break
            workers = sorted(matcher.counts)
            if not workers:
                return {}
            pipe = c.pipeline(transaction=False)
            for w in workers:
                pipe.exists(self.keys.worker(w))
            live = pipe.execute()
            return {w: matcher.counts[w] for w, alive in zip(workers, live, strict=True) if alive}

        return self.link.run("match_prefix", match)

    # ---- reaper ------------------------------------------------------------------------------
    def reap(self, now: float | None = None) -> ReapReport:
        """Reclaim what dead peers left: transfers past their lease are deleted and their blocks
        queued for their decode worker; index entries of workers whose registry entry expired are dropped.
        Any worker may run it at any time; concurrent runs settle each item exactly once."""
        report = ReapReport()
        now_arg = _now_arg(now)

        def reap_transfers(c):
            cutoff = now_arg if now_arg >= 0 else self._redis_now_ms(c)
            while True:
                due = c.zrangebyscore(self.keys.leases, "-inf", cutoff, start=0, num=_REAP_BATCH)
                for request_id in due:
                    queued = self._s["REAP_TRANSFER"](
                        keys=[self.keys.transfer(request_id), self.keys.leases],
                        args=[request_id, cutoff, self.keys.reclaims_prefix, RECLAIM_TTL_MS], client=c,
                    )  # fmt: skip
                    if queued >= 0:
                        report.expired_transfers.append(request_id)
                        report.reclaims_queued += queued
                if len(due) < _REAP_BATCH:
                    return

        def reap_workers(c):
            ids = sorted(c.smembers(self.keys.workers))
            pipe = c.pipeline(transaction=False)
            for wid in ids:
                pipe.exists(self.keys.worker(wid))
            for wid, alive in zip(ids, pipe.execute(), strict=True):
                if alive:
                    continue
                removed = self._s["DROP_WORKER_INDEX"](
                    keys=[self.keys.worker(wid), self.keys.workers, self.keys.worker_blocks(wid)],
                    args=[wid, self.keys.block_prefix], client=c,
                )  # fmt: skip
                if removed >= 0:
                    report.dead_workers.append(wid)
                    report.index_entries_removed += removed

        self.link.run("reap", reap_transfers)
        self.link.run("reap", reap_workers)
        if report.expired_transfers or report.dead_workers:
            log.info("reaper: %d expired transfers (%d reclaims queued), dead workers %s",
                     len(report.expired_transfers), report.reclaims_queued, report.dead_workers)  # fmt: skip
        return report

    @staticmethod
    def _redis_now_ms(c) -> int:
        seconds, micros = c.time()
        return int(seconds) * 1000 + int(micros) // 1000
