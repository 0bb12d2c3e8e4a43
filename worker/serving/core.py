"""Engine-thread state of a worker: which request streams where, prefills being shipped, KV awaited.

Every method whose name starts with `on_loop_` runs on the engine-loop thread (submitted through
`EngineLoop.call`), so the engine, the KV transport and these tables need no locks. Each
request's blocks are released exactly once: by the engine when it finishes or is aborted, by
`release` after a prefill's KV left, or by `abort` of a reservation.

KV writes are one-sided, so blocks a transfer may still write are never reused before it settles
(landed, or the sender's ABORT notice, which it sends only once its writes settled): P keeps an
aborted transfer's source blocks until its abort settled; D holds a given-up transfer's blocks
apart from the request (quarantine, keyed by the transfer id) until it settles or a deadline
passes, so the request can retry into fresh blocks or prefill locally under the same id.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from disagg.proto import worker_pb2 as pb
from disagg.worker.engine.block_hash import block_hashes
from disagg.worker.engine.block_manager import NoFreeBlocksError
from disagg.worker.engine.llm_engine import Reservation
from disagg.worker.engine.outputs import RequestOutput, TokenLogprob
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.kv_transfer.handle import PENDING
from disagg.worker.serving.disagg_policy import PrefillSite
from disagg.worker.serving.engine_loop import SOON, yield_cpu
from disagg.worker.serving.layer_sends import LayerSends
from disagg.worker.serving.metrics import ServingMetrics
from disagg.worker.serving.prefill_estimate import DecodeStepTime, PrefillRate

log = logging.getLogger("disagg.worker.core")

# P polls a computed prompt's sends at the spin rate for this long (they take ~1 ms on a host)
SENDS_SOON_SECONDS = 0.05
# how long the loop waits, after committing a landed remote prefill, for its first message to go
# out before it steps again (typically 0.2-0.4 ms; a stream that is slower just goes on later)
FIRST_TOKEN_HANDOFF_SECONDS = 0.002
REFUSED_TRANSFERS_KEPT = 4096  # aborted-before-arrival transfer ids remembered (a Prefill trails by ms)

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
    sends: LayerSends | None = None  # its per-layer sends, once a layer hook ran
    failed: str = ""
    state: str = "prefilling"  # prefilling -> sending -> (aborting) -> released
    abort: object = None  # the transport's abort handle while "aborting"
    held: bool = False  # its blocks are held under `hold_key` (aborted mid-prefill)
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

    @property
    def hold_key(self) -> str:
        return f"abort:{self.engine_id}"


@dataclass
class KVWait:
    """D waits for a transfer id to land."""

    request_id: str
    done: Callable[[str | None], None]  # None = landed, else the failure reason
    block_ids: list[int] = field(default_factory=list)  # the blocks the transfer may write
    quarantine: bool = False  # given up on: settling the transfer frees its held blocks
    # Set when the request may start decoding from the token the transfer's FINAL carries: the
    # loop commits it the moment the KV is complete and calls this (with the time) before `done`.
    # The first token then skips P's answer leg and a visit to this loop from the asyncio thread.
    # It may return an event the loop waits on (briefly) before its next step: the first message
    # written to the stream.
    committed: Callable[[float], threading.Event | None] | None = None


def settles(reason: str | None) -> bool:
    """Whether a transfer's outcome means nothing more of it will land: it completed, or the
    sender aborted it (its ABORT notice follows its last write). A stall or a lost connection
    says nothing about writes still in flight."""
    return reason is None or reason.startswith("aborted")


def quarantine_key(transfer_id: str) -> str:
    return f"quarantine:{transfer_id}"


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
        self.quarantined: dict[str, float] = {}  # D: transfer id given up on -> deadline of its held blocks
        self.aborting: dict[str, PrefillJob] = {}  # P: engine id -> job whose abort has not settled
        # P: transfer ids aborted before their prefill arrived (a Prefill RPC may trail its Abort):
        # refused if it comes, so "not found" is a promise that nothing of it will be written
        self.refused_transfers: OrderedDict[str, None] = OrderedDict()
        self.quarantine_seconds = 30.0
        self._published_prefill: set[str] = set()
        self._on_publish = on_publish
        self.load: dict[str, int | float] = {}
        self.prefill_rate = PrefillRate()
        self.decode_step = DecodeStepTime()
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
        if request_id in self.sinks or request_id in self.reserved:
            sink = self.sinks.pop(request_id, None)
            waiting = request_id in self.reserved
            self.reserved.discard(request_id)
            if waiting:
                self._quarantine_waits(request_id)
            self.engine.abort(request_id)
            if sink is not None and request_id not in self.prefills:
                sink(None)  # the stream ends with finish_reason "abort"
            found = True
        for eid in [e for e, j in self.prefills.items() if j.request_id == request_id or e == request_id]:
            self._drop_prefill(self.prefills[eid], "aborted by the decode worker")
            found = True
        if any(e == request_id or j.request_id == request_id for e, j in self.aborting.items()):
            found = True  # dropped already, its sends not settled yet: its ABORT notice follows
        if not found:
            self.refused_transfers[request_id] = None
            if len(self.refused_transfers) > REFUSED_TRANSFERS_KEPT:
                self.refused_transfers.popitem(last=False)
        return found

    def _quarantine_waits(self, request_id: str) -> None:
        """KV may still be landing in the blocks of `request_id`'s transfers: hold them."""
        for tid in [t for t, w in self.kv_waits.items() if w.request_id == request_id and not w.quarantine]:
            waiter = self.kv_waits[tid]
            self._quarantine(tid)
            waiter.done("aborted")

    def _quarantine(self, transfer_id: str) -> None:
        """Hold the blocks `transfer_id` may write, apart from its request, until the transfer
        settles (lands, or the sender's ABORT notice arrives) or the quarantine deadline."""
        waiter = self.kv_waits[transfer_id]
        self._hold(quarantine_key(transfer_id), waiter.block_ids)
        self.kv_waits[transfer_id] = KVWait(waiter.request_id, lambda _r: None, waiter.block_ids, True)
        self.quarantined[transfer_id] = time.monotonic() + self.quarantine_seconds
        self.metrics.kv_quarantined.inc()

    def _unquarantine(self, transfer_id: str) -> None:
        if self.quarantined.pop(transfer_id, None) is not None:
            self.kv_waits.pop(transfer_id, None)
            self.transport.forget(transfer_id)
            self.engine.block_manager.unpin(quarantine_key(transfer_id))

    def _hold(self, key: str, block_ids: list[int]) -> None:
        """Keep `block_ids` allocated under `key` (a reference of its own) until `unpin(key)`,
        whatever happens to the request that holds them now."""
        bm = self.engine.block_manager
        bm.acquire(block_ids)
        bm.pin(key, block_ids)

    def on_loop_cached_tokens(self, prompt_ids: list[int]) -> int:
        """Leading prompt tokens this worker's prefix cache holds (what a local prefill would skip)."""
        hashes = block_hashes(prompt_ids, self.block_size)
        return len(self.engine.block_manager.lookup(hashes, prompt_ids)) * self.block_size

    def on_loop_place(
        self,
        request_id: str,
        prompt_ids: list[int],
        params,
        sink: Sink,
        arrival: float,
        decide: Callable[[int, PrefillSite, int], tuple[bool, str]],
        expect: tuple,
    ) -> tuple[str, Reservation | None]:
        """Where a decode worker prefills `prompt_ids`, decided and acted on in one visit to this
        loop (each visit may wait for a running step, and this is on the first token's path):
        `decide(cached tokens, this worker as a prefill site, streams decoding)` -> (remote, reason)
        prices it; remote: blocks reserved and the KV awaited (`expect`: the transfer id, `done`
        and `committed` of `on_loop_expect_kv`), the reservation returned; local, or no room to
        reserve the whole prompt now: the request is queued here (None), waiting for blocks there."""
        cached, local, decoding = self.on_loop_prefill_price(prompt_ids)
        remote, reason = decide(cached, local, decoding)
        if remote:
            try:
                return reason, self.on_loop_reserve_expecting(request_id, prompt_ids, params, sink, *expect)
            except NoFreeBlocksError:
                pass
        self.on_loop_add(request_id, prompt_ids, params, sink, arrival)
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

    def on_loop_reserve_expecting(
        self, request_id: str, prompt_ids: list[int], params, sink: Sink, transfer_id: str, done,
        committed: Callable[[float], threading.Event | None] | None = None,
    ) -> Reservation:  # fmt: skip
        """`on_loop_reserve` and `on_loop_expect_kv` for its fresh blocks: the remote branch of
        `on_loop_place`, in the same visit to the engine loop."""
        blocks = self.on_loop_reserve(request_id, prompt_ids, params, sink)
        self.on_loop_expect_kv(transfer_id, request_id, done, blocks.fresh_block_ids, committed)
        return blocks

    def on_loop_expect_kv(
        self,
        transfer_id: str,
        request_id: str,
        done: Callable[[str | None], None],
        block_ids: list[int],
        committed: Callable[[float], threading.Event | None] | None = None,
    ) -> bool:
        """Register interest in a transfer into `request_id`'s blocks `block_ids` (the only ones
        it may write); False if the request is gone. `committed`: see `KVWait`."""
        if request_id not in self.reserved:
            return False
        self.kv_waits[transfer_id] = KVWait(request_id, done, list(block_ids), committed=committed)
        self.transport.accept(transfer_id, block_ids)
        return True

    def on_loop_end_attempt(self, transfer_id: str, sender_settled: bool) -> bool:
        """A remote prefill attempt failed. `sender_settled`: the sender said (or showed, by
        being gone) that nothing more of it will land. Otherwise its blocks go to quarantine
        until it settles; True then: the request's next attempt needs fresh blocks."""
        waiter = self.kv_waits.get(transfer_id)
        if waiter is None:
            return False  # settled already
        if sender_settled:
            if waiter.quarantine:  # quarantined by an abort of the request: nothing can land now
                self._unquarantine(transfer_id)
            else:
                del self.kv_waits[transfer_id]
                self.transport.forget(transfer_id)
            return False
        if waiter.quarantine:
            return False  # quarantined by an abort of the request, until the transfer settles
        self._quarantine(transfer_id)
        return True

    def on_loop_rereserve(self, request_id: str, prompt_ids: list[int], params) -> Reservation | None:
        """Fresh blocks for the request's next attempt, its last ones being quarantined (None:
        the request is gone). Raises NoFreeBlocksError, the request then holding nothing."""
        if request_id not in self.reserved:
            return None
        self.engine.abort(request_id)
        try:
            return self.engine.reserve(request_id, prompt_ids, params)
        except Exception:
            self.reserved.discard(request_id)
            raise

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

    def poll_receiver(self) -> bool | str:
        """Resolve KV waits from the transport's completions and failures; SOON while a transfer
        whose FINAL notice came still misses parts: they land within a fraction of a millisecond
        (the last layers' parts trail P's FINAL, which P sends the moment its compute ends, by
        0.2-1.3 ms) and would otherwise wait up to a whole `poll_wait` for the next poll."""
        if self.transport is None:
            return False
        outcomes = [(tid, None) for tid in self.transport.poll_completed()]
        first_tokens = {tid: self.transport.take_first_token(tid) for tid, _ in outcomes}
        for tid, reason in outcomes + self.transport.poll_failed():
            waiter = self.kv_waits.get(tid)
            if waiter is None:
                continue
            if waiter.quarantine:
                if settles(reason):
                    self._unquarantine(tid)
                continue
            if settles(reason):  # else it stays: ending the attempt decides about its blocks
                del self.kv_waits[tid]
            handoff = None
            if reason is None and waiter.committed is not None:
                handoff = self._commit_on_landing(waiter, first_tokens.get(tid))
            waiter.done(None if reason is None else reason or "transfer failed")
            if handoff is not None:
                handoff()
        if self.quarantined:
            now = time.monotonic()
            for tid in [t for t, deadline in self.quarantined.items() if deadline < now]:
                log.warning("freeing the blocks of KV transfer %s: it never settled", tid)
                self._unquarantine(tid)
        if self.kv_waits and self.transport.finishing():
            return SOON
        return bool(self.kv_waits) or bool(self.quarantined)

    def _commit_on_landing(self, waiter: KVWait, token_id: int | None) -> Callable[[], None] | None:
        """Start decoding a landed remote prefill from the token its FINAL carried; without one
        (an older or tensor-parallel sender) the asyncio side commits from P's answer. Returns
        what to do once the waiter was told (None: nothing was committed)."""
        if token_id is None or not self.on_loop_commit(waiter.request_id, token_id, None):
            return None
        sent = waiter.committed(time.monotonic())
        # The first token is in the asyncio thread's queue. That thread shares this one's core:
        # left to the scheduler, it ran 0.3-5 ms into the next step (a yield alone did not keep
        # it from being preempted before its write); waiting here gives it the core until then.
        if sent is None:
            return yield_cpu
        return lambda: sent.wait(FIRST_TOKEN_HANDOFF_SECONDS)

    def on_loop_add_peer(self, peer_id: str, payload: bytes) -> None:
        """Cache a decode worker's handshake; the same payload again is a no-op, since replacing
        a peer fails the transfers in flight to it."""
        if self._peer_payloads.get(peer_id) == payload and self.transport.has_peer(peer_id):
            return
        self.transport.add_peer(peer_id, payload)
        self._peer_payloads[peer_id] = payload

    # ---- P: prefill-only requests whose KV is written into D's blocks ------------------------------
    def on_loop_prefill(self, job: PrefillJob, prompt_ids: list[int], params, arrival: float) -> None:
        if job.engine_id in self.refused_transfers:
            job.done({"error": ("prefill_failed", "aborted by the decode worker before it started")})
            return
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
            if job.sends is not None:  # the step is over: every layer's K/V is written or being written
                job.sends.flush()
            else:  # no layer hook ran (e.g. the whole prompt was cached): all at once
                src, dst = self._send_blocks(job)
                job.handles.append(self.transport.send(job.peer_id, job.engine_id, src, dst))
            job.handles.append(self.transport.finish(job.peer_id, job.engine_id, first_token=job.token_id))
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

    def _layer_sends(self, job: PrefillJob) -> LayerSends:
        if job.sends is None:

            def post(layer: int) -> None:
                src, dst = self._send_blocks(job)
                job.handles.append(self.transport.send(job.peer_id, job.engine_id, src, dst, layers=[layer]))

            job.sends = LayerSends(post)
        return job.sends

    def _kv_written(self) -> torch.cuda.Event | None:
        """An event that completes once the K/V the device has been given so far is written (None
        on a CPU, whose forward pass is synchronous)."""
        if not self.engine.kv_cache.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.engine.kv_cache.device))
        return event

    def _layer_hook(self, layer: int) -> None:
        """After layer `layer` was given its K/V writes: ship that layer of every prompt this step
        completes once the device has written it (`LayerSends`), so the transfer of early layers
        overlaps the compute of later ones."""
        scheduled = self.engine.scheduled
        if scheduled is None:
            return
        written = None
        for chunk in scheduled.chunks:
            job = self.prefills.get(chunk.request.request_id)
            if job is None or job.state != "prefilling" or not chunk.samples or job.failed:
                continue
            try:
                written = written or self._kv_written()
                self._layer_sends(job).add(layer, written)
            except Exception as e:
                # the engine is mid-step: fail the job once the step is over (see `_prefilled`)
                job.failed = f"KV send failed: {e}"

    def poll_sender(self) -> bool | str:
        """Finish prefills whose KV has left: release the pinned blocks, answer D. SOON while a
        computed prompt's sends are out: only polling moves them (no NIXL progress thread)."""
        for job in [j for j in self.aborting.values() if j.abort.poll() != PENDING]:
            self._aborted(job)
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
        now = time.monotonic()
        sending = [j for j in self.prefills.values() if j.state == "sending"]
        if any(now - (j.prefilled_at or 0.0) < SENDS_SOON_SECONDS for j in sending):
            return SOON  # a slow receiver's sends go back to `poll_wait` polls after that
        return bool(sending) or bool(self.aborting)

    def _drop_prefill(self, job: PrefillJob, reason: str) -> None:
        """Give up on a prefill: tell D, free its blocks (running, or pinned after prefill) and
        answer D. Sends already posted may still read the blocks and write D's: then the blocks
        and the answer wait until the transport's abort settled (its ABORT notice went out)."""
        self.prefills.pop(job.engine_id, None)
        self.sinks.pop(job.engine_id, None)
        job.failed = reason
        if job.sends is not None:  # nothing more may be posted after the ABORT notice
            job.sends.drop()
        try:
            job.abort = self.transport.abort(job.peer_id, job.engine_id, reason)
        except Exception:
            log.debug("abort notice for %s failed", job.engine_id)
            job.abort = None
        settling = job.abort is not None and job.abort.poll() == PENDING
        if job.state != "sending":
            if settling and job.engine_id in self.engine.requests:
                self._hold(job.hold_key, self.engine.block_ids(job.engine_id))
                job.held = True
            self.engine.abort(job.engine_id)
        if settling:
            job.state = "aborting"
            self.aborting[job.engine_id] = job
        else:
            self._aborted(job)

    def _aborted(self, job: PrefillJob) -> None:
        """The dropped prefill's sends settled: its blocks go back, D gets its answer (so an
        answer from P, like its ABORT notice, means nothing more of the transfer will land)."""
        self.aborting.pop(job.engine_id, None)
        if job.held:
            self.engine.block_manager.unpin(job.hold_key)
        elif job.state in ("sending", "aborting"):
            self.engine.release(job.engine_id)
        job.state = "released"
        job.done({"error": ("prefill_failed", job.failed)})

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
        jobs = [*self.prefills.values(), *self.aborting.values()]
        self.aborting.clear()
        for job in jobs:
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
            self.prefill_rate.observe(n, best, provisional=True)

    # ---- the step ----------------------------------------------------------------------------------
    def step(self) -> None:
        hook = self._layer_hook if any(j.state == "prefilling" for j in self.prefills.values()) else None
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
        reserved_blocks = sum(len(e.requests[r].block_ids) for r in self.reserved if r in e.requests)
        reserved_blocks += sum(len(bm.pinned(quarantine_key(t)) or ()) for t in self.quarantined)
        jobs = [*self.prefills.values(), *self.aborting.values()]
        pinned_blocks = sum(len(bm.pinned(j.hold_key if j.held else j.engine_id) or ()) for j in jobs)
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
            + len(self.aborting)
            + len(self.kv_waits)
            + len(self.reserved),
            "kv_transfers_inflight": sum(1 for j in self.prefills.values() if j.state == "sending")
            + len(self.aborting)
            + len(self.kv_waits),
            "queued_prefill_tokens": self.queued_prefill_tokens(),
            "prefill_tokens_per_s": self.prefill_rate.tokens_per_s or 0.0,
            "decode_step_seconds": self.decode_step.seconds or 0.0,
        }
        self.metrics.running.set(e.num_running)
        self.metrics.waiting.set(e.num_waiting + len(self.reserved))
        self.metrics.kv_blocks(e.num_free_blocks, e.num_total_blocks)
        if e.speculator is not None:
            self.metrics.speculation(e.speculator.stats)

    def load_response(self, worker_id: str, role: str) -> pb.LoadResponse:
        return pb.LoadResponse(worker_id=worker_id, role=role, **self.load)
