"""A prefill worker's (P's) side of a remote prefill, on the engine-loop thread: prefill-only
jobs, their KV sent layer by layer into the decode worker's (D's) blocks, and their reclaim.

A job is PREFILLING while the engine computes it; each layer of its last chunk is posted as the
model finishes it (`LayerSends`: on a GPU once the device wrote it). Computed, it is SENDING:
the engine pins its blocks until every send is done, then it answers D and releases them. A job
dropped while sends it posted may still read its blocks and write D's is ABORTING: its blocks and
its answer wait until the transport's abort settled (its ABORT notice went out), so an answer
from P, like its ABORT notice, means nothing more of the transfer will land.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch

from disagg.worker.engine.outputs import RequestOutput
from disagg.worker.kv_transfer.handle import PENDING
from disagg.worker.serving.engine_loop import SOON
from disagg.worker.serving.held_blocks import hold
from disagg.worker.serving.layer_sends import LayerSends
from disagg.worker.serving.prefill_job import JobState, PrefillError, PrefillJob

log = logging.getLogger("disagg.worker.kv_sender")

# P polls a computed prompt's sends at the spin rate for this long (they take ~1 ms on a host)
SENDS_SOON_SECONDS = 0.05
REFUSED_TRANSFERS_KEPT = 4096  # aborted-before-arrival transfer ids remembered (a Prefill trails by ms)


class KVSender:
    """Every method runs on the engine-loop thread. `sinks` is the worker's table of where each
    engine request's outputs go (a job's outputs come back to `_prefilled`); `on_sent(prompt)`
    is told of each prompt whose KV went out (its blocks are in this worker's prefix cache)."""

    def __init__(self, engine, transport, sinks: dict, on_sent=None):
        self.engine = engine
        self.transport = transport
        self.sinks = sinks
        self.on_sent = on_sent or (lambda _prompt: None)
        self.jobs: dict[str, PrefillJob] = {}  # engine id -> job, PREFILLING or SENDING
        self.aborting: dict[str, PrefillJob] = {}  # engine id -> job whose abort has not settled
        # transfer ids aborted before their prefill arrived (a Prefill RPC may trail its Abort):
        # refused if it comes, so "not found" is a promise that nothing of it will be written
        self.refused: OrderedDict[str, None] = OrderedDict()
        self.kv_bytes_sent = 0
        self._peer_payloads: dict[str, bytes] = {}

    # ---- what the rest of the worker asks ----------------------------------------------------------
    @property
    def prefilling(self) -> bool:
        return any(j.state == JobState.PREFILLING for j in self.jobs.values())

    @property
    def sending(self) -> int:
        return sum(1 for j in self.jobs.values() if j.state == JobState.SENDING)

    def pinned_blocks(self) -> int:
        bm = self.engine.block_manager
        jobs = [*self.jobs.values(), *self.aborting.values()]
        return sum(len(bm.pinned(j.hold_key if j.held else j.engine_id) or ()) for j in jobs)

    def scheduled(self, engine_id: str, at: float) -> None:
        """The job's first prefill step began at `at` (the end of its queueing)."""
        job = self.jobs.get(engine_id)
        if job is not None and job.scheduled_at is None:
            job.scheduled_at = at

    # ---- handshakes and jobs -----------------------------------------------------------------------
    def add_peer(self, peer_id: str, payload: bytes) -> None:
        """Cache a decode worker's handshake; the same payload again is a no-op, since replacing
        a peer fails the transfers in flight to it."""
        if self._peer_payloads.get(peer_id) == payload and self.transport.has_peer(peer_id):
            return
        self.transport.add_peer(peer_id, payload)
        self._peer_payloads[peer_id] = payload

    def submit(self, job: PrefillJob, prompt_ids: list[int], params) -> bool:
        """Queue the job's prompt as a prefill-only request; False when refused (answered)."""
        if job.engine_id in self.refused:
            job.done(PrefillError("prefill_failed", "aborted by the decode worker before it started"))
            return False
        if not self.transport.has_peer(job.peer_id):
            job.done(PrefillError("handshake_required", f"no KV handshake with {job.peer_id}"))
            return False
        self.engine.add_request(job.engine_id, prompt_ids, params, prefill_only=True)
        self.jobs[job.engine_id] = job
        self.sinks[job.engine_id] = lambda out: self._prefilled(job, out)
        return True

    def _prefilled(self, job: PrefillJob, out: RequestOutput) -> None:
        if not out.finished:
            return
        if job.failed and out.finish_reason == "prefilled":
            job.state = JobState.SENDING
            self.drop(job, job.failed)
            return
        if out.finish_reason != "prefilled":  # the engine already freed its blocks
            self.drop(job, f"prefill ended with {out.finish_reason}")
            return
        comp = out.outputs[0]
        job.token_id = comp.token_ids[0]
        job.logprob = comp.logprobs[0] if comp.logprobs else None
        job.prompt_logprobs = out.prompt_logprobs
        job.cached_tokens = out.num_cached_tokens
        job.prefilled_at = time.monotonic()
        job.state = JobState.SENDING  # from here on the blocks are pinned until `release`
        try:
            if job.sends is not None:  # the step is over: every layer's K/V is written or being written
                job.sends.flush()
            else:  # no layer hook ran (e.g. the whole prompt was cached): all at once
                src, dst = self._send_blocks(job)
                job.handles.append(self.transport.send(job.peer_id, job.engine_id, src, dst))
            job.handles.append(self.transport.finish(job.peer_id, job.engine_id, first_token=job.token_id))
        except Exception as e:  # UnknownPeer (evicted), bad ids: the request fails, blocks go back
            self.drop(job, f"KV send failed: {e}")
            return
        self.on_sent(out.prompt_token_ids)

    # ---- per-layer sends ---------------------------------------------------------------------------
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

    def layer_hook(self, layer: int) -> None:
        """After layer `layer` was given its K/V writes: ship that layer of every prompt this step
        completes once the device has written it (`LayerSends`), so the transfer of early layers
        overlaps the compute of later ones."""
        scheduled = self.engine.scheduled
        if scheduled is None:
            return
        written = None
        for chunk in scheduled.chunks:
            job = self.jobs.get(chunk.request.request_id)
            if job is None or job.state != JobState.PREFILLING or not chunk.samples or job.failed:
                continue
            try:
                written = written or self._kv_written()
                self._layer_sends(job).add(layer, written)
            except Exception as e:
                # the engine is mid-step: fail the job once the step is over (see `_prefilled`)
                job.failed = f"KV send failed: {e}"

    # ---- settling ----------------------------------------------------------------------------------
    def poll(self) -> bool | str:
        """Finish prefills whose KV has left: release the pinned blocks, answer D. SOON while a
        computed prompt's sends are out: only polling moves them (no NIXL progress thread)."""
        for job in [j for j in self.aborting.values() if j.abort.poll() != PENDING]:
            self._aborted(job)
        for job in [j for j in self.jobs.values() if j.state == JobState.SENDING]:
            states = [h.poll() for h in job.handles]
            if "error" in states:
                bad = next(h for h in job.handles if h.state == "error")
                self.drop(job, f"KV transfer failed ({bad.error_kind}): {bad.reason}")
            elif all(s == "done" for s in states):
                self.jobs.pop(job.engine_id, None)
                self.engine.release(job.engine_id)
                nbytes = sum(h.bytes for h in job.handles)
                self.kv_bytes_sent += nbytes
                job.done(job.result(nbytes, time.monotonic()))
        now = time.monotonic()
        sending = [j for j in self.jobs.values() if j.state == JobState.SENDING]
        if any(now - (j.prefilled_at or 0.0) < SENDS_SOON_SECONDS for j in sending):
            return SOON  # a slow receiver's sends go back to `poll_wait` polls after that
        return bool(sending) or bool(self.aborting)

    def drop(self, job: PrefillJob, reason: str) -> None:
        """Give up on a prefill: tell D, free its blocks (running, or pinned after prefill) and
        answer D. Sends already posted may still read the blocks and write D's: then the blocks
        and the answer wait until the transport's abort settled (its ABORT notice went out)."""
        self.jobs.pop(job.engine_id, None)
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
        if job.state != JobState.SENDING:
            if settling and job.engine_id in self.engine.requests:
                hold(self.engine.block_manager, job.hold_key, self.engine.block_ids(job.engine_id))
                job.held = True
            self.engine.abort(job.engine_id)
        if settling:
            job.state = JobState.ABORTING
            self.aborting[job.engine_id] = job
        else:
            self._aborted(job)

    def _aborted(self, job: PrefillJob) -> None:
        """The dropped prefill's sends settled: its blocks go back, D gets its answer."""
        self.aborting.pop(job.engine_id, None)
        if job.held:
            self.engine.block_manager.unpin(job.hold_key)
        elif job.state in (JobState.SENDING, JobState.ABORTING):
            self.engine.release(job.engine_id)
        job.state = JobState.RELEASED
        job.done(PrefillError("prefill_failed", job.failed))

    def abort(self, request_id: str, found: bool) -> bool:
        """D gave up on `request_id` (D's request id or one attempt's transfer id); `found`: the
        worker held something else of it. Whether anything of it was (or is still settling)
        here; if nothing, a Prefill for it that comes later is refused."""
        for eid in [e for e, j in self.jobs.items() if j.request_id == request_id or e == request_id]:
            self.drop(self.jobs[eid], "aborted by the decode worker")
            found = True
        if any(e == request_id or j.request_id == request_id for e, j in self.aborting.items()):
            found = True  # dropped already, its sends not settled yet: its ABORT notice follows
        if not found:
            self.refused[request_id] = None
            if len(self.refused) > REFUSED_TRANSFERS_KEPT:
                self.refused.popitem(last=False)
        return found

    def reclaim(self, transfer_id: str) -> bool:
        """The reaper says a transfer's lease expired: drop its job (False: no such job)."""
        job = self.jobs.get(transfer_id)
        if job is None:
            return False
        self.drop(job, "transfer lease expired")
        return True

    def fail_all(self, reason: str) -> None:
        """The engine is unusable: every job is answered with `reason`, nothing more is sent."""
        jobs = [*self.jobs.values(), *self.aborting.values()]
        self.aborting.clear()
        for job in jobs:
            self.jobs.pop(job.engine_id, None)
            self.sinks.pop(job.engine_id, None)
            job.state = JobState.RELEASED
            job.done(PrefillError("engine_failed", reason))
