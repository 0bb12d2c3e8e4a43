"""Engine-thread state of a worker: which request streams where, prefills being shipped, KV awaited.

Every method whose name starts with `on_loop_` runs on the engine-loop thread (submitted through
`EngineLoop.call`), so the engine, the KV transport and these tables need no locks. Each
request's blocks are released exactly once: by the engine when it finishes or is aborted, by
`release` after a prefill's KV left, or by `abort` of a reservation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from disagg.proto import worker_pb2 as pb
from disagg.worker.engine.block_hash import block_hashes
from disagg.worker.engine.llm_engine import Reservation
from disagg.worker.engine.outputs import RequestOutput, TokenLogprob
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.serving.metrics import ServingMetrics
from disagg.worker.serving.prefill_estimate import PrefillRate

log = logging.getLogger("disagg.worker.core")

Sink = Callable[[RequestOutput], None]


@dataclass
class PrefillJob:
    """A prefill-only request on P whose KV goes to D's blocks."""

    engine_id: str  # the transfer id: unique per attempt
    request_id: str  # D's request id (for Abort)
    peer_id: str
    dst_block_ids: list[int]
    skip_blocks: int
    done: Callable[[dict], None]  # called once with the result (first token or error)
    token_id: int = -1
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0
    handles: list = field(default_factory=list)
    layers_sent: int = 0
    failed: str = ""
    state: str = "prefilling"  # prefilling -> sending -> (released)
    started: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # its first prefill step began
    prefilled_at: float | None = None  # its last prompt token was computed

    def stage_seconds(self, now: float) -> dict[str, float]:
        """Queue (until the first step), compute, and the KV still moving after the compute."""
        scheduled = self.scheduled_at if self.scheduled_at is not None else self.started
        prefilled = self.prefilled_at if self.prefilled_at is not None else now
        return {
            "queue_seconds": max(scheduled - self.started, 0.0),
            "compute_seconds": max(prefilled - scheduled, 0.0),
            "seconds": max(now - prefilled, 0.0),
        }


@dataclass
class KVWait:
    """D waits for a transfer id to land."""

    request_id: str
    done: Callable[[str | None], None]  # None = landed, else the failure reason
    quarantine: bool = False  # the request is gone; settling the transfer frees its blocks


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
        self.sinks: dict[str, Sink] = {}
        self.prefills: dict[str, PrefillJob] = {}  # engine id -> job
        self.kv_waits: dict[str, KVWait] = {}  # transfer id -> waiter
        self.reserved: set[str] = set()  # D request ids with reserved blocks not yet committed
        self.quarantined: dict[str, float] = {}  # aborted D requests whose KV may still land -> deadline
        self.quarantine_seconds = 30.0
        self._published_prefill: set[str] = set()
        self._on_publish = on_publish
        self.load: dict[str, int | float] = {}
        self.prefill_rate = PrefillRate()
        self.kv_bytes_sent = 0
        self._peer_payloads: dict[str, bytes] = {}

    # ---- local generation (decode/both workers) ---------------------------------------------------
    def on_loop_add(self, request_id: str, prompt_ids: list[int], params, sink: Sink, arrival: float) -> None:
        self.engine.add_request(request_id, prompt_ids, params)
        self.sinks[request_id] = sink
        self.arrivals[request_id] = arrival

    def on_loop_abort(self, request_id: str) -> bool:
        """Abort everything this worker holds for `request_id` (a stream, a reservation, prefills)."""
        found = False
        self._published_prefill.discard(request_id)
        self.arrivals.pop(request_id, None)
        waits = [t for t, w in self.kv_waits.items() if w.request_id == request_id and not w.quarantine]
        if request_id in self.reserved and waits:
            # KV may still be landing in these blocks: hold them until the transfer settles
            # (completes, or the sender's abort notice arrives) or the lease runs out
            self.reserved.discard(request_id)
            self.quarantined[request_id] = time.monotonic() + self.quarantine_seconds
            for tid in waits:
                waiter = self.kv_waits[tid]
                self.kv_waits[tid] = KVWait(
                    request_id, lambda _r, rid=request_id: self._unquarantine(rid), True
                )
                waiter.done("aborted")
            sink = self.sinks.pop(request_id, None)
            if sink is not None:
                sink(None)
            return True
        if request_id in self.sinks or request_id in self.reserved:
            sink = self.sinks.pop(request_id, None)
            self.reserved.discard(request_id)
            self.engine.abort(request_id)
            if sink is not None and request_id not in self.prefills:
                sink(None)  # the stream ends with finish_reason "abort"
            found = True
        for tid in waits:
            waiter = self.kv_waits.pop(tid)
            self.transport.forget(tid)
            waiter.done("aborted")
            found = True
        for eid in [e for e, j in self.prefills.items() if j.request_id == request_id or e == request_id]:
            self._drop_prefill(self.prefills[eid], "aborted by the decode worker")
            found = True
        return found

    def _unquarantine(self, request_id: str) -> None:
        if self.quarantined.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            for tid in [t for t, w in self.kv_waits.items() if w.request_id == request_id]:
                del self.kv_waits[tid]
                self.transport.forget(tid)

    def on_loop_cached_tokens(self, prompt_ids: list[int]) -> int:
        """Leading prompt tokens this worker's prefix cache holds (what a local prefill would skip)."""
        hashes = block_hashes(prompt_ids, self.block_size)
        return len(self.engine.block_manager.lookup(hashes, prompt_ids)) * self.block_size

    def on_loop_prefill_price(self, prompt_ids: list[int]) -> tuple[int, int, float | None, int]:
        """What pricing a local prefill of `prompt_ids` needs: its cached tokens here, the prompt
        tokens already queued here, this worker's prefill rate, and how many streams it decodes."""
        return (
            self.on_loop_cached_tokens(prompt_ids),
            self.queued_prefill_tokens(),
            self.prefill_rate.tokens_per_s,
            self.engine.num_running,
        )

    def queued_prefill_tokens(self) -> int:
        """Prompt (or recomputation) tokens not yet computed: waiting requests and part-way ones.
        A running request with one token left is decoding, not queued for prefill."""
        sched = self.engine.scheduler
        waiting = sum(r.num_uncomputed for r in sched.waiting)
        return waiting + sum(r.num_uncomputed for r in sched.running if r.num_uncomputed > 1)

    def on_loop_evicted(self, hashes: list[int]) -> list[int]:
        """Which of `hashes` the prefix cache no longer holds (their blocks were reused)."""
        lookup = self.engine.block_manager.lookup
        return [h for h in hashes if not lookup([h])]

    # ---- D: reserve, await KV, commit ---------------------------------------------------------------
    def on_loop_reserve(self, request_id: str, prompt_ids: list[int], params, sink: Sink) -> Reservation:
        """Blocks for a remote prefill; the leading `num_cached_blocks` come from the prefix cache."""
        blocks = self.engine.reserve(request_id, prompt_ids, params)
        self.reserved.add(request_id)
        self.sinks[request_id] = sink
        return blocks

    def on_loop_expect_kv(
        self, transfer_id: str, request_id: str, done: Callable[[str | None], None], block_ids: list[int]
    ) -> bool:
        """Register interest in a transfer into `request_id`'s blocks `block_ids` (the only ones
        it may write); False if the request is gone."""
        if request_id not in self.reserved:
            return False
        self.kv_waits[transfer_id] = KVWait(request_id, done)
        self.transport.accept(transfer_id, block_ids)
        return True

    def on_loop_forget_kv(self, transfer_id: str) -> None:
        waiter = self.kv_waits.get(transfer_id)
        if waiter is not None and not waiter.quarantine:
            del self.kv_waits[transfer_id]
            self.transport.forget(transfer_id)

    def on_loop_commit(
        self,
        request_id: str,
        token_id: int,
        logprob: TokenLogprob | None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> bool:
        if request_id not in self.reserved:
            return False  # aborted meanwhile (client gone): the abort freed the blocks
        self.reserved.discard(request_id)
        self._dispatch(self.engine.commit_remote_prefill(request_id, token_id, logprob, prompt_logprobs))
        return True

    def poll_receiver(self) -> bool:
        """Resolve KV waits from the transport's completions and failures."""
        if self.transport is None:
            return False
        for tid in self.transport.poll_completed():
            waiter = self.kv_waits.pop(tid, None)
            if waiter is not None:
                waiter.done(None)
        for tid, reason in self.transport.poll_failed():
            waiter = self.kv_waits.pop(tid, None)
            if waiter is not None:
                waiter.done(reason or "transfer failed")
        if self.quarantined:
            now = time.monotonic()
            for rid in [r for r, deadline in self.quarantined.items() if deadline < now]:
                log.warning("freeing blocks of aborted request %s: its KV transfer never settled", rid)
                self._unquarantine(rid)
        return bool(self.kv_waits) or bool(self.quarantined)

    def on_loop_add_peer(self, peer_id: str, payload: bytes) -> None:
        """Cache a decode worker's handshake; the same payload again is a no-op, since replacing
        a peer fails the transfers in flight to it."""
        if self._peer_payloads.get(peer_id) == payload and self.transport.has_peer(peer_id):
            return
        self.transport.add_peer(peer_id, payload)
        self._peer_payloads[peer_id] = payload

    # ---- P: prefill-only requests whose KV is written into D's blocks ------------------------------
    def on_loop_prefill(self, job: PrefillJob, prompt_ids: list[int], params, arrival: float) -> None:
        if not self.transport.has_peer(job.peer_id):
            job.done({"error": ("handshake_required", f"no KV handshake with {job.peer_id}")})
            return
        self.engine.add_request(job.engine_id, prompt_ids, params, prefill_only=True)
        self.arrivals[job.engine_id] = arrival
        self.prefills[job.engine_id] = job
        self.sinks[job.engine_id] = lambda out: self._prefilled(job, out)

    def _prefilled(self, job: PrefillJob, out: RequestOutput) -> None:
        if not out.finished:
            return
        if job.failed and out.finish_reason == "prefilled":
            job.state = "sending"
            self._drop_prefill(job, job.failed)
            return
        if out.finish_reason != "prefilled":  # the engine already freed its blocks
            self._drop_prefill(job, f"prefill ended with {out.finish_reason}")
            return
        comp = out.outputs[0]
        job.token_id = comp.token_ids[0]
        job.logprob = comp.logprobs[0] if comp.logprobs else None
        job.prompt_logprobs = out.prompt_logprobs
        job.cached_tokens = out.num_cached_tokens
        job.prefilled_at = time.monotonic()
        job.state = "sending"  # from here on the blocks are pinned until `release`
        try:
            if not job.layers_sent:  # no layer hook ran (e.g. the whole prompt was cached): all at once
                src, dst = self._send_blocks(job)
                job.handles.append(self.transport.send(job.peer_id, job.engine_id, src, dst))
            job.handles.append(self.transport.finish(job.peer_id, job.engine_id))
        except Exception as e:  # UnknownPeer (evicted), bad ids: the request fails, blocks go back
            self._drop_prefill(job, f"KV send failed: {e}")
            return
        self._publish_prompt(out.prompt_token_ids)

    def _send_blocks(self, job: PrefillJob) -> tuple[list[int], list[int]]:
        src = list(self.engine.block_ids(job.engine_id))
        if len(src) != len(job.dst_block_ids):
            raise ValueError(f"block count mismatch: {len(src)} computed, {len(job.dst_block_ids)} reserved")
        k = job.skip_blocks
        return src[k:], job.dst_block_ids[k:]

    def _layer_hook(self, layer: int) -> None:
        """After layer `layer` wrote its K/V: ship that layer of every prompt this step completes,
        so the transfer of early layers overlaps the compute of later ones."""
        scheduled = self.engine.scheduled
        if scheduled is None:
            return
        for chunk in scheduled.chunks:
            job = self.prefills.get(chunk.request.request_id)
            if job is None or job.state != "prefilling" or not chunk.samples or job.failed:
                continue
            try:
                src, dst = self._send_blocks(job)
                job.handles.append(self.transport.send(job.peer_id, job.engine_id, src, dst, layers=[layer]))
                job.layers_sent += 1
            except Exception as e:
                # the engine is mid-step: fail the job once the step is over (see `_prefilled`)
                job.failed = f"KV send failed: {e}"

    def poll_sender(self) -> bool:
        """Finish prefills whose KV has left: release the pinned blocks, answer D."""
        for job in [j for j in self.prefills.values() if j.state == "sending"]:
            states = [h.poll() for h in job.handles]
            if "error" in states:
                bad = next(h for h in job.handles if h.state == "error")
                self._drop_prefill(job, f"KV transfer failed ({bad.error_kind}): {bad.reason}")
            elif all(s == "done" for s in states):
                self.prefills.pop(job.engine_id, None)
                self.engine.release(job.engine_id)
                nbytes = sum(h.bytes for h in job.handles)
                self.kv_bytes_sent += nbytes
                job.done(
                    {
                        "token_id": job.token_id,
                        "logprob": job.logprob,
                        "prompt_logprobs": job.prompt_logprobs,
                        "cached_tokens": job.cached_tokens,
                        "kv_bytes": nbytes,
                        **job.stage_seconds(time.monotonic()),
                    }
                )
        return any(j.state == "sending" for j in self.prefills.values())

    def _drop_prefill(self, job: PrefillJob, reason: str) -> None:
        """Give up on a prefill: free its blocks (running, or pinned after prefill) and answer D."""
        self.prefills.pop(job.engine_id, None)
        self.sinks.pop(job.engine_id, None)
        if job.state == "sending":
            self.engine.release(job.engine_id)
        else:
            self.engine.abort(job.engine_id)
        # tell D not to wait for this transfer (it may hold its blocks until the transfer settles)
        try:
            self.transport.abort(job.peer_id, job.engine_id, reason)
        except Exception:
            log.debug("abort notice for %s failed", job.engine_id)
        job.state = "released"
        job.done({"error": ("prefill_failed", reason)})

    def on_loop_reclaim(self, transfer_or_request_id: str) -> bool:
        """The reaper says a transfer's lease expired: free whatever we still hold for it."""
        job = self.prefills.get(transfer_or_request_id)
        if job is not None:
            self._drop_prefill(job, "transfer lease expired")
            return True
        return self.on_loop_abort(transfer_or_request_id)

    def on_loop_fail_all(self, error: BaseException) -> None:
        """The engine is unusable: every request this worker holds ends now, with `error`."""
        reason = str(error)
        for job in list(self.prefills.values()):
            self.prefills.pop(job.engine_id, None)
            self.sinks.pop(job.engine_id, None)
            job.state = "released"
            job.done({"error": ("engine_failed", reason)})
        for tid, waiter in list(self.kv_waits.items()):
            del self.kv_waits[tid]
            waiter.done(reason)
        sinks, self.sinks = list(self.sinks.values()), {}
        self.reserved.clear()
        for sink in sinks:
            sink(error)

    # ---- start-up --------------------------------------------------------------------------------
    def warm_up(self, max_tokens: int = 256, passes: int = 3) -> None:
        """Prefill a random prompt a few times before serving: the first pass pays the one-off
        costs (kernel builds, allocator growth, cold caches) that a user's first request would pay,
        the fastest later pass seeds this worker's prefill rate (the fastest: other processes
        starting beside this one only ever slow a pass down), so load-aware placement can price
        prefills from the first request on. Leaves the engine as it found it (no request, stats
        reset)."""
        e = self.engine
        sched = e.scheduler
        n = min(max_tokens, sched.max_num_batched_tokens, e.max_model_len - 1,
                (e.num_free_blocks - 1) * self.block_size)  # fmt: skip
        if n < self.prefill_rate.min_tokens:
            return
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, e.config.vocab_size, (n,), generator=g).tolist()
        stats = (sched.prefix_query_tokens, sched.prefix_hit_tokens, sched.num_preemptions)
        best = None
        for i in range(passes):
            # each pass must compute, not hit the prefix cache the one before filled
            prompt[0] = (prompt[0] + 1) % e.config.vocab_size
            e.add_request(f"warm-up-{i}", prompt, SamplingParams(max_tokens=1, temperature=0))
            started = time.monotonic()
            while e.has_unfinished():
                e.step()
            if i:
                best = min(best or float("inf"), time.monotonic() - started)
        sched.prefix_query_tokens, sched.prefix_hit_tokens, sched.num_preemptions = stats
        if best is not None:
            self.prefill_rate.observe(n, best)

    # ---- the step ----------------------------------------------------------------------------------
    def step(self) -> None:
        hook = self._layer_hook if any(j.state == "prefilling" for j in self.prefills.values()) else None
        started = time.monotonic()
        outs = self.engine.step(layer_hook=hook)
        scheduled = self.engine.scheduled
        if scheduled is not None and scheduled.is_prefill:
            self.prefill_rate.observe(scheduled.num_tokens, time.monotonic() - started)
        if scheduled is not None and self.arrivals:
            for chunk in scheduled.chunks:
                rid = chunk.request.request_id
                arrival = self.arrivals.pop(rid, None)
                if arrival is not None:
                    self.metrics.queue_time.observe(max(started - arrival, 0.0))
                    job = self.prefills.get(rid)
                    if job is not None and job.scheduled_at is None:
                        job.scheduled_at = started
        for out in outs:
            self._dispatch(out)

    def _dispatch(self, out: RequestOutput) -> None:
        rid = out.request_id
        sink = self.sinks.get(rid)
        if out.finished:
            self.sinks.pop(rid, None)
        # a prompt prefilled here (or landed here): its full blocks are in this worker's prefix cache
        if rid not in self._published_prefill and rid not in self.prefills and out.new_token_ids:
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

    def refresh_load(self) -> None:
        """Snapshot the accounting (on the loop thread) for Load RPCs, heartbeats and gauges."""
        e = self.engine
        bm = e.block_manager
        held = self.reserved | self.quarantined.keys()
        reserved_blocks = sum(len(e.requests[r].block_ids) for r in held if r in e.requests)
        pinned_blocks = sum(len(bm.pinned(j.engine_id) or ()) for j in self.prefills.values())
        self.load = {
            "running": e.num_running,
            "waiting": e.num_waiting,
            "free_blocks": e.num_free_blocks,
            "total_blocks": e.num_total_blocks,
            "used_blocks": e.num_total_blocks - e.num_free_blocks,
            "reserved_blocks": reserved_blocks,
            "pinned_blocks": pinned_blocks,
            "inflight_requests": len(self.sinks)
            + len(self.prefills)
            + len(self.kv_waits)
            + len(self.reserved),
            "kv_transfers_inflight": sum(1 for j in self.prefills.values() if j.state == "sending")
            + len(self.kv_waits),
            "queued_prefill_tokens": self.queued_prefill_tokens(),
            "prefill_tokens_per_s": self.prefill_rate.tokens_per_s or 0.0,
        }
        self.metrics.running.set(e.num_running)
        self.metrics.waiting.set(e.num_waiting + len(self.reserved))
        self.metrics.kv_blocks(e.num_free_blocks, e.num_total_blocks)
        if e.speculator is not None:
            self.metrics.speculation(e.speculator.stats)

    def load_response(self, worker_id: str, role: str) -> pb.LoadResponse:
        return pb.LoadResponse(worker_id=worker_id, role=role, **self.load)
