"""The router's view of the workers: membership (Redis registry and/or static addresses), their
load (polled over gRPC `Load`, fresher than heartbeats and independent of Redis), one gRPC
channel per worker, and the router's own count of requests in flight on each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc

from disagg.proto import worker_pb2, worker_pb2_grpc
from disagg.worker.router.policy import WorkerView
from disagg.worker.router.readiness import REASONS, registry_problem
from disagg.worker.serving.auth import INSECURE, InternalAuth
from disagg.worker.serving.stubs import WorkerStubs

log = logging.getLogger("disagg.router.workers")

_POLL_TIMEOUT = 2.0
_SLOW_POLLS_TOLERATED = 3


@dataclass
class _Member:
    address: str
    view: WorkerView | None = None  # None until a Load answered
    ready: bool = False
    failures: int = 0


class WorkerPool:
    """Known workers and their gRPC stubs.

    `members_source` returns the (worker_id, role, address) triples from the registry; it may
    raise when Redis is down, in which case the last known membership is kept.
    """

    def __init__(
        self,
        members_source: Callable[[], list[tuple[str, str, str]]] | None = None,
        static_addresses: list[str] | None = None,
        refresh_seconds: float = 0.5,
        model: str | None = None,
        auth: InternalAuth = INSECURE,
    ):
        self._source = members_source
        self._static = list(static_addresses or [])
        self._refresh = refresh_seconds
        self._model = model
        self._members: dict[str, _Member] = {a: _Member(a) for a in self._static}
        self._stubs = WorkerStubs(auth)
        self._inflight: dict[str, int] = {}
        self._task: asyncio.Task | None = None
        # why the registry could not be read (a readiness reason code), None while it can
        self.registry_problem: str | None = None if self._source is None else "registry_not_read"
        self._refreshed = asyncio.Event()

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._stubs.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._refresh)
            try:
                await self.refresh()
            except Exception:  # the loop must survive anything a worker or Redis does
                log.exception("worker refresh failed")

    async def next_refresh(self, timeout: float) -> None:
        """Wait for the next poll of every worker to finish (at most `timeout` seconds)."""
        self._refreshed.clear()
        try:
            await asyncio.wait_for(self._refreshed.wait(), timeout)
        except TimeoutError:
            pass

    @property
    def registry_ok(self) -> bool:
        return self.registry_problem is None

    @property
    def uses_registry(self) -> bool:
        return self._source is not None

    @property
    def refresh_seconds(self) -> float:
        return self._refresh

    # ---- membership and load ----------------------------------------------------------------
    async def _registry_members(self) -> list[tuple[str, str, str]] | None:
        if self._source is None:
            return None
        try:
            members = await asyncio.wait_for(asyncio.to_thread(self._source), timeout=2.0)
        except Exception as e:
            problem = registry_problem(e)
            if problem != self.registry_problem:
                log.warning(
                    "worker registry unavailable (%s: %s): keeping the last known workers",
                    REASONS[problem],
                    e,
                )
            self.registry_problem = problem
            return None
        if self.registry_problem not in (None, "registry_not_read"):
            log.info("worker registry reachable again")
        self.registry_problem = None
        return members

    async def refresh(self) -> None:
        members = await self._registry_members()
        if members is not None:
            wanted = {addr for _id, _role, addr in members} | set(self._static)
            for addr in wanted - self._members.keys():
                self._members[addr] = _Member(addr)
            # A worker that left the registry (deregistered, or heartbeat expired) and no longer
            # answers is dropped; one that still answers stays until its TTL really runs out.
            for addr in list(self._members.keys() - wanted):
                if not self._members[addr].ready:
                    await self._drop(addr)
        await asyncio.gather(*(self._poll(m) for m in list(self._members.values())))
        self._refreshed.set()

    async def _poll(self, m: _Member) -> None:
        try:
            load = await self.stub(m.address).Load(worker_pb2.LoadRequest(), timeout=_POLL_TIMEOUT)
            health = await self.stub(m.address).Health(worker_pb2.HealthRequest(), timeout=_POLL_TIMEOUT)
        except grpc.aio.AioRpcError as e:
            m.failures += 1
            # a refused connection is a dead worker; a slow answer is usually a busy one, which
            # stays in rotation until it has been silent for a few polls
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or m.failures >= _SLOW_POLLS_TOLERATED:
                self._set_ready(m, False, f"poll failed ({e.code().name}: {e.details()})")
            return
        m.failures = 0
        m.view = WorkerView(
            worker_id=load.worker_id,
            role=load.role,
            address=m.address,
            running=load.running,
            waiting=load.waiting,
            free_blocks=load.free_blocks,
            total_blocks=load.total_blocks,
            queued_prefill_tokens=load.queued_prefill_tokens,
            prefill_tokens_per_s=load.prefill_tokens_per_s,
            decode_step_seconds=load.decode_step_seconds,
            quantization=health.quantization,
        )
        if not health.ready:
            self._set_ready(m, False, "not ready")
        elif health.draining:
            self._set_ready(m, False, "draining")
        elif self._model and health.model != self._model:
            self._set_ready(m, False, f"serves model {health.model!r}, not {self._model!r}")
        else:
            self._set_ready(m, True, "ready")

    @staticmethod
    def _set_ready(m: _Member, ready: bool, why: str) -> None:
        """Every change of a worker's rotation state is logged with its reason: a worker that leaves
        rotation is what a 503 "no worker is ready" comes from."""
        if ready != m.ready:
            name = m.view.worker_id if m.view else "worker"
            log.log(logging.INFO if ready else logging.WARNING, "%s at %s %s rotation: %s",
                    name, m.address, "joins" if ready else "leaves", why)  # fmt: skip
        m.ready = ready

    async def _drop(self, addr: str) -> None:
        self._members.pop(addr, None)
        await self._stubs.drop(addr)

    def mark_failed(self, worker_id: str) -> None:
        """A call to the worker failed: stop routing to it until its next successful poll."""
        for m in self._members.values():
            if m.view and m.view.worker_id == worker_id:
                self._set_ready(m, False, "a call to it failed")

    def views(self) -> list[WorkerView]:
        out = []
        for m in self._members.values():
            if m.ready and m.view is not None:
                out.append(replace(m.view, inflight=self._inflight.get(m.view.worker_id, 0)))
        return out

    def all_views(self) -> list[tuple[WorkerView | None, bool, str]]:
        return [(m.view, m.ready, m.address) for m in self._members.values()]

    # ---- calls ------------------------------------------------------------------------------
    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        return self._stubs.stub(address)

    def begin(self, worker_id: str) -> None:
        self._inflight[worker_id] = self._inflight.get(worker_id, 0) + 1

    def end(self, worker_id: str) -> None:
        n = self._inflight.get(worker_id, 0) - 1
        if n > 0:
            self._inflight[worker_id] = n
        else:
            self._inflight.pop(worker_id, None)
