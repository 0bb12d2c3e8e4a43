"""Engine-thread state of a worker: which request streams where, and the two sides of a remote
prefill (`KVSender` on a prefill worker, `KVReceiver` on a decode worker).

Every method whose name starts with `on_loop_` runs on the engine-loop thread (submitted through
`EngineLoop.call`), so the engine, the KV transport and these tables need no locks. Each
request's blocks are released exactly once: by the engine when it finishes or is aborted, by
the sender after a prefill's KV left, or by an abort of a reservation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from disagg.proto import worker_pb2 as pb
from disagg.worker.engine.block_hash import block_hashes
from disagg.worker.engine.block_manager import NoFreeBlocksError
from disagg.worker.engine.llm_engine import Reservation
from disagg.worker.engine.outputs import RequestOutput
from disagg.worker.engine.resume import with_outputs
from disagg.worker.serving.disagg_policy import Placement, PrefillSite, place
from disagg.worker.serving.kv_receiver import KVReceiver
from disagg.worker.serving.kv_sender import KVSender
from disagg.worker.serving.metrics import ServingMetrics
from disagg.worker.serving.prefill_estimate import DecodeStepTime, PrefillRate
from disagg.worker.serving.prefill_job import PrefillJob

log = logging.getLogger("disagg.worker.core")

Sink = Callable[[RequestOutput], None]


class WorkerCore:
    def __init__(
        self,
        engine,
        transport,
        block_size: int,
        metrics: ServingMetrics,
        on_publish: Callable[[list[int]], None] | None = None,
    ):
        self.engine = engine
        self.metrics = metrics
        self.arrivals: dict[str, float] = {}  # request id -> arrival, until first scheduled
        self.transport = transport
        self.block_size = block_size
        self.sinks: dict[str, Sink] = {}  # engine request id -> where its outputs go
        self.sender = KVSender(engine, transport, self.sinks, on_sent=self._publish_prompt)
        self.receiver = KVReceiver(engine, transport, metrics, self.sinks, self._dispatch)
        self._published_prefill: set[str] = set()
        self._on_publish = on_publish
        self.load: dict[str, int | float] = {}
        self.prefill_rate = PrefillRate()
        self.decode_step = DecodeStepTime()

    # ---- requests -----------------------------------------------------------------------------------
    def on_loop_add(
        self, request_id: str, prompt_ids: list[int], params, sink: Sink, arrival: float, resume=None
    ) -> None:
        """A request prefilled and decoded here (`resume`: continuing outputs another worker made)."""
        self.engine.add_request(request_id, prompt_ids, params, resume=resume)
        self.sinks[request_id] = sink
        self.arrivals[request_id] = arrival

    def on_loop_prefill(self, job: PrefillJob, prompt_ids: list[int], params, arrival: float) -> None:
        """A prefill-only request whose KV goes to a decode worker (answered through `job.done`)."""
        if self.sender.submit(job, prompt_ids, params):
            self.arrivals[job.engine_id] = arrival

    def on_loop_abort(self, request_id: str) -> bool:
        """Abort everything this worker holds for `request_id` (a stream, a reservation, prefills)."""
        found = False
        self._published_prefill.discard(request_id)
        self.arrivals.pop(request_id, None)
        if request_id in self.sinks or request_id in self.receiver.reserved:
            sink = self.sinks.pop(request_id, None)
            self.receiver.abort(request_id)
            self.engine.abort(request_id)
            if sink is not None and request_id not in self.sender.jobs:
                sink(None)  # the stream ends with finish_reason "abort"
            found = True
        return self.sender.abort(request_id, found)

    def on_loop_reclaim(self, transfer_or_request_id: str) -> bool:
        """The reaper says a transfer's lease expired: free whatever we still hold for it."""
        return self.sender.reclaim(transfer_or_request_id) or self.on_loop_abort(transfer_or_request_id)

    def on_loop_fail_all(self, error: BaseException) -> None:
        """The engine is unusable: every request this worker holds ends now, with `error`."""
        reason = str(error)
        self.sender.fail_all(reason)
        self.receiver.fail_all(reason)
        sinks = list(self.sinks.values())
        self.sinks.clear()  # shared with the sender and the receiver: cleared, not replaced
        for sink in sinks:
            sink(error)

    # ---- placement (decode workers) ---------------------------------------------------------------
    def on_loop_place(
        self,
        request_id: str,
        prompt_ids: list[int],
        params,
        sink: Sink,
        arrival: float,
        placement: Placement,
        expect: tuple,
        resume=None,
    ) -> tuple[str, Reservation | None]:
        """Where a decode worker prefills `prompt_ids`, decided (`disagg_policy.place`) and acted
        on in one visit to this loop (each visit may wait for a running step, and this is on the
        first token's path): remote: blocks reserved and the KV awaited (`expect`: the transfer
        id, `done` and `committed` of `KVReceiver.expect`), the reservation returned; local, or no
        room to reserve the whole prompt now: the request is queued here (None), waiting for
        blocks there. Returns the decision's reason too. `resume`: a moved stream's outputs,
        prefilled with the prompt."""
        decision = place(placement, *self.on_loop_prefill_price(with_outputs(prompt_ids, resume)))
        if decision.local_s is not None:
            log.debug(
                "prefill of %d tokens: local %.1f ms, remote %.1f ms -> %s (%s)",
                placement.prompt_len, decision.local_s * 1e3, decision.remote_s * 1e3,
                "remote" if decision.remote else "local", decision.reason,
            )  # fmt: skip
        reason = decision.reason
        if decision.remote:
            try:
                return reason, self.receiver.reserve_expecting(
                    request_id, prompt_ids, params, sink, *expect, resume
                )
            except NoFreeBlocksError:
                reason = "no_free_blocks"  # it waits here for blocks, queued as a local prefill
        self.on_loop_add(request_id, prompt_ids, params, sink, arrival, resume)
        return reason, None

    def on_loop_prefill_price(self, prompt_ids: list[int]) -> tuple[int, PrefillSite, int]:
        """What pricing a local prefill of `prompt_ids` needs: its cached tokens here, this worker
        as a prefill site (tokens queued, its rate), and how many streams it decodes."""
        rate = self.prefill_rate
        return (
            self.on_loop_cached_tokens(prompt_ids),
            PrefillSite(self.queued_prefill_tokens(), rate.tokens_per_s, rate.fresh()),
            self.engine.num_running,
        )

    def on_loop_cached_tokens(self, prompt_ids: list[int]) -> int:
        """Leading prompt tokens this worker holds, in its prefix cache or a tier below it (what a
        local prefill would skip)."""
        return self.engine.cached_prefix_tokens(prompt_ids)

    def queued_prefill_tokens(self) -> int:
        """Prompt (or recomputation) tokens not yet computed: waiting requests and part-way ones.
        A running request with one token left is decoding, not queued for prefill."""
        sched = self.engine.scheduler
        waiting = sum(r.num_uncomputed for r in sched.waiting)
        return waiting + sum(r.num_uncomputed for r in sched.running if r.num_uncomputed > 1)

    def on_loop_evicted(self, hashes: list[int]) -> list[int]:
        """Which of `hashes` neither the prefix cache nor a tier below it holds any more."""
        return [h for h in hashes if not self.engine.holds_block(h)]

    # ---- the step ----------------------------------------------------------------------------------
    def step(self) -> None:
        hook = self.sender.layer_hook if self.sender.prefilling else None
        started = time.monotonic()
        outs = self.engine.step(layer_hook=hook)
        elapsed = time.monotonic() - started
        scheduled = self.engine.scheduled
        if scheduled is not None:
            self.metrics.engine_step(scheduled.is_prefill, elapsed, len(scheduled.chunks))
            if scheduled.is_prefill:
                self.prefill_rate.observe(scheduled.num_tokens, elapsed)
            else:
                self.decode_step.observe(elapsed)
        if scheduled is not None and self.arrivals:
            for chunk in scheduled.chunks:
                rid = chunk.request.request_id
                arrival = self.arrivals.pop(rid, None)
                if arrival is not None:
                    self.metrics.queue_time.observe(max(started - arrival, 0.0))
                    self.sender.scheduled(rid, started)
        for out in outs:
            self._dispatch(out)

    def _dispatch(self, out: RequestOutput) -> None:
        rid = out.request_id
        sink = self.sinks.get(rid)
        if out.finished:
            self.sinks.pop(rid, None)
        # a prompt prefilled here (or landed here): its full blocks are in this worker's prefix cache
        if rid not in self._published_prefill and rid not in self.sender.jobs and out.new_token_ids:
            self._published_prefill.add(rid)
            self._publish_prompt(out.prompt_token_ids)
        if out.finished:
            self._published_prefill.discard(rid)
        if sink is not None:
            sink(out)

    def _publish_prompt(self, prompt_ids: list[int]) -> None:
        if self._on_publish is not None and self.engine.block_manager.enable_prefix_caching:
            hashes = block_hashes(prompt_ids, self.block_size)
            if hashes:
                self._on_publish(hashes)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    # ---- load ----------------------------------------------------------------------------------------
    def refresh_load(self) -> None:
        """Snapshot the accounting (on the loop thread) for Load RPCs, heartbeats and gauges."""
        e, sender, receiver = self.engine, self.sender, self.receiver
        self.load = {
            "running": e.num_running,
            "waiting": e.num_waiting,
            "free_blocks": e.num_free_blocks,
            "total_blocks": e.num_total_blocks,
            "used_blocks": e.num_total_blocks - e.num_free_blocks,
            "reserved_blocks": receiver.reserved_blocks(),
            "pinned_blocks": sender.pinned_blocks(),
            "inflight_requests": len(self.sinks)
            + len(sender.jobs)
            + len(sender.aborting)
            + len(receiver.kv_waits)
            + len(receiver.reserved),
            "kv_transfers_inflight": sender.sending + len(sender.aborting) + len(receiver.kv_waits),
            "queued_prefill_tokens": self.queued_prefill_tokens(),
            "prefill_tokens_per_s": self.prefill_rate.tokens_per_s or 0.0,
            "decode_step_seconds": self.decode_step.seconds or 0.0,
        }
        self.metrics.running.set(e.num_running)
        self.metrics.waiting.set(e.num_waiting + len(receiver.reserved))
        self.metrics.kv_blocks(e.num_free_blocks, e.num_total_blocks)
        if e.speculator is not None:
            self.metrics.speculation(e.speculator.stats)
        if e.tiers is not None:
            self.metrics.kv_tiers(e.tiers)

    def load_response(self, worker_id: str, role: str) -> pb.LoadResponse:
        return pb.LoadResponse(worker_id=worker_id, role=role, **self.load)
