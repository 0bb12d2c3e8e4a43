"""A decode worker's remote prefill, on its asyncio side: placement, attempts with their
handshakes, retries, the transfer record's lease, and what each finished prefill teaches the
cost estimate. The engine-loop side is `KVReceiver` (reached only through `EngineLoop.call`).

Up to two prefill workers are tried (the router's first candidates). A failed attempt whose KV
may still land has its blocks quarantined and the retry writes fresh ones; when every attempt
failed the request holds nothing of them, and the caller prefills it locally.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from disagg.proto import worker_pb2 as pb
from disagg.worker.engine.block_manager import NoFreeBlocksError
from disagg.worker.serving.args import ServingArgs
from disagg.worker.serving.attempt import MAX_ATTEMPTS, Attempt, PrefillAborted, PrefillFailed, RequestGone
from disagg.worker.serving.convert import logprob_from_proto, prompt_logprobs_from_proto
from disagg.worker.serving.disagg_policy import Placement, PrefillSite
from disagg.worker.serving.metrics import ServingMetrics
from disagg.worker.serving.peer_handshakes import PeerHandshakes
from disagg.worker.serving.prefill_estimate import RemoteCost
from disagg.worker.serving.remote_prefill_request import (
    RESUMED_PREFILL_PARAMS,
    RemotePrefillRequest,
    Stage,
    prefill_params,
)
from disagg.worker.serving.transfer_record import TransferRecord

log = logging.getLogger("disagg.worker.remote_prefill")


class RemotePrefill:
    def __init__(
        self,
        worker_id: str,
        address: str,
        args: ServingArgs,
        kv_wait_timeout: float,
        loop,
        core,
        state,
        metrics: ServingMetrics,
        stubs,
    ):
        self.worker_id = worker_id
        self.args = args
        self.kv_wait_timeout = kv_wait_timeout
        self.loop = loop
        self.core = core
        self.receiver = core.receiver
        self.state = state
        self.metrics = metrics
        self._stubs = stubs
        self.cost = RemoteCost()  # what a remote prefill costs beyond P's queue and compute
        self.handshakes = PeerHandshakes(
            worker_id, address, lambda: self._call(core.transport.handshake_payload), stubs
        )
        self.background: set[asyncio.Task] = set()  # what finishes after the first token

    async def _call(self, fn, *args):
        return await asyncio.wrap_future(self.loop.call(fn, *args))

    async def close(self) -> None:
        if self.background:
            await asyncio.wait(self.background, timeout=5.0)

    def _keep(self, task: asyncio.Task) -> None:
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # ---- placement --------------------------------------------------------------------------------
    def placement(self, prompt_len: int, target: pb.PrefillTarget) -> Placement:
        return Placement(
            prompt_len,
            PrefillSite(
                target.queued_prefill_tokens,
                target.prefill_tokens_per_s or None,
                cached_tokens=target.cached_tokens,
            ),  # fmt: skip
            self.cost.seconds,
            self.args.prefill_placement,
            self.args.disagg_threshold,
            self.args.disagg_busy_slack,
        )

    async def prefill(
        self, rid, prompt, request: pb.GenerateRequest, params, sink, arrival, first_sent, resume=None
    ) -> tuple[str | None, str]:
        """Place the prompt's prefill and, when it goes remote, have it done there: (the prefill
        worker's id, or None when the request was queued here; the placement's reason). Raises
        PrefillFailed when no prefill worker could do it (the request then holds nothing).
        `resume`: a moved stream's outputs, prefilled with the prompt (the request then goes on
        from its last output)."""
        targets = list(request.prefill_targets)[:MAX_ATTEMPTS]
        attempt = Attempt.new(rid, 0, prefill_params(request, resume), first_sent)
        job = RemotePrefillRequest(rid, prompt, request, params, sink, resume, targets, attempt, arrival)
        reason = await self._place(job)
        if job.dst is None:
            return None, reason
        return await self._attempts(job), reason

    async def _place(self, job: RemotePrefillRequest) -> str:
        """Price the prompt's prefill here and on the router's first choice of prefill worker, and
        act on it, in one engine-loop visit: the placement's reason; `job.dst` holds the blocks
        reserved for a remote prefill, or stays None when the request was queued here."""
        placement = self.placement(len(job.tokens), job.targets[0])
        try:
            reason, job.dst = await self._call(
                self.core.on_loop_place, job.rid, job.prompt, job.params, job.sink, job.arrival, placement,
                job.attempt.expect, job.resume,
            )  # fmt: skip
        except asyncio.CancelledError:
            # The loop may have reserved and begun awaiting the transfer before the cancel took
            # effect. No Prefill went out, so nothing can land: end that wait as settled (queued
            # behind the placement), or the request's abort would quarantine its blocks for a
            # transfer that never comes. The caller's abort frees the reservation.
            await self._call(self.receiver.end_attempt, job.attempt.transfer_id, True)
            raise
        job.stage = Stage.QUEUED_HERE if job.dst is None else Stage.RESERVED
        return reason

    # ---- a handed-off stream ----------------------------------------------------------------------
    async def pull(self, rid, prompt, request: pb.GenerateRequest, params, resume, sink) -> str:
        """Pull the K/V of a stream a draining worker handed off (its prompt and the outputs it
        streamed: `request.prefill_targets[0]`, which samples nothing used here) into blocks
        reserved for the resumed request, which goes on from its last output once they landed.
        Returns the holder's id. Raises PrefillFailed when nothing could be pulled (the request
        then holds nothing here: the caller recomputes it) or PrefillAborted."""
        attempt = Attempt.new(rid, 0, RESUMED_PREFILL_PARAMS)
        targets = list(request.prefill_targets[:1])
        job = RemotePrefillRequest(rid, prompt, request, params, sink, resume, targets, attempt)
        try:
            job.dst = await self._call(
                self.receiver.reserve_expecting, rid, prompt, params, sink, *attempt.expect, resume
            )
        except NoFreeBlocksError as e:
            raise PrefillFailed(f"no free blocks to pull into: {e}") from None
        except asyncio.CancelledError:
            await self._call(self.receiver.end_attempt, attempt.transfer_id, True)
            raise
        job.stage = Stage.RESERVED
        return await self._attempts(job)

    # ---- attempts ---------------------------------------------------------------------------------
    async def _attempts(self, job: RemotePrefillRequest) -> str:
        """Have a prefill worker fill the blocks `job.dst` reserved for its first attempt (retrying
        once elsewhere), commit. Returns the prefill worker's id; raises PrefillFailed after the
        blocks were freed (or, for a failed attempt whose KV may still land, quarantined apart
        from the request)."""
        # Nothing precedes the first attempt to fence it against, so P gets generation 0
        # (unchecked); a retry starts only after the failed attempt's Abort, which P honours by
        # transfer id, and carries its record's generation.
        job.record = record = TransferRecord(self.state, job.rid, self.args.lease_seconds, self.background)
        record.begin(job.targets[0].worker_id, job.dst.fresh_block_ids)
        try:
            for number, target in enumerate(job.targets):
                if number:
                    self.metrics.prefill_retries.inc()
                    record.begin(target.worker_id, job.dst.fresh_block_ids, await record.generation())
                    job.next_attempt()
                try:
                    if number and not await self._expect_kv(job):
                        raise RequestGone(job.rid)
                    await self._prefill_once(job)
                    record.finish_later()
                    return target.worker_id
                except asyncio.CancelledError:
                    await self._cleanup_attempt(job)
                    raise
                except RequestGone:
                    # aborted meanwhile (Abort RPC, lease reclaim): the abort owns the blocks now
                    await self._cleanup_attempt(job)
                    job.stage = Stage.ABORTED
                    raise PrefillAborted(f"request {job.rid} was aborted") from None
                except (PrefillFailed, grpc.aio.AioRpcError, TimeoutError) as e:
                    reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                    log.warning(
                        "prefill of %s on %s failed (attempt %d, %s): %s",
                        job.rid,
                        target.worker_id,
                        number + 1,
                        job.stage.value,
                        reason,
                    )
                    job.failures.append(f"{target.worker_id}: {reason}")
                    if isinstance(e, grpc.aio.AioRpcError):
                        self.handshakes.forget(target.worker_id)
                    quarantined = await self._cleanup_attempt(job)
                    if quarantined and number + 1 < len(job.targets):
                        # its KV may still land in those blocks: the retry writes fresh ones
                        try:
                            job.dst = await self._call(
                                self.receiver.rereserve, job.rid, job.prompt, job.params, job.resume
                            )
                        except NoFreeBlocksError:
                            job.failures.append("no free blocks to retry into")
                            break
                        if job.dst is None:
                            job.stage = Stage.ABORTED
                            raise PrefillAborted(f"request {job.rid} was aborted") from None
            await self._call(self.core.on_loop_abort, job.rid)
            job.stage = Stage.FAILED
            raise PrefillFailed("; ".join(job.failures) or "no prefill worker available")
        except BaseException:
            # every way out but success (which finishes it after the first token) finishes the
            # latest attempt's record, a cancel between attempts included: a record left behind
            # holds the transfer's blocks in the index until its lease runs out
            await record.finish()
            raise

    async def _expect_kv(self, job: RemotePrefillRequest) -> bool:
        """Have the engine loop wait for a retry's KV in `job.dst`'s fresh blocks (False: request
        gone)."""
        tid, landed, committed = job.attempt.expect
        expecting = await self._call(
            self.receiver.expect, tid, job.rid, landed, job.dst.fresh_block_ids, committed
        )
        job.stage = Stage.RESERVED
        return expecting

    async def _cleanup_attempt(self, job: RemotePrefillRequest) -> bool:
        """Stop the failed current attempt on P and let go of its KV wait; True when its blocks
        went to quarantine (P, slow rather than dead, may still write into them)."""
        attempt = job.attempt
        settled = not attempt.in_flight
        try:  # P may still hold the prompt (slow, not dead): tell it to let go
            resp = await self._stubs.stub(job.target.address).Abort(
                pb.AbortRequest(request_id=attempt.transfer_id), timeout=1.0
            )
            # not found: P holds nothing of the attempt (never started, or its sends all done)
            # and refuses it if its Prefill arrives later; found: its ABORT notice settles it
            settled = settled or not resp.found
        except grpc.aio.AioRpcError as e:
            # nothing listens at P's address any more: the process, and its writes, are gone
            settled = settled or e.code() == grpc.StatusCode.UNAVAILABLE
        return await self._call(self.receiver.end_attempt, attempt.transfer_id, settled)

    async def _prefill_once(self, job: RemotePrefillRequest) -> None:
        """The current attempt, the engine loop already waiting for its KV (the first attempt sends
        P generation 0 and does not wait for its record).

        Returns once the request is committed: by the engine loop when the KV landed with the
        first token in P's FINAL notice (P's answer, with its timings, is then awaited apart), or
        here from P's answer."""
        attempt, target, dst = job.attempt, job.target, job.dst
        gen = await job.record.generation() if attempt.number else 0
        stub = self._stubs.stub(target.address)
        req = pb.PrefillRequest(
            request_id=job.rid,
            prompt_token_ids=job.tokens,
            params=job.prefill_params,
            decode_worker_id=self.worker_id,
            dst_block_ids=dst,  # the whole prompt's blocks: P skips the leading cached ones itself
            transfer_generation=gen,
            transfer_id=attempt.transfer_id,
            skip_leading_blocks=dst.num_cached_blocks,
            handoff_of=job.handoff_of,
        )
        renew = job.record.renew()
        call = None
        try:
            handshakes = 0.0  # once per peer, not a cost of each prompt: left out of the stages
            for _ in range(2):  # a second time only after a fresh handshake
                shaking = time.monotonic()
                await self.handshakes.ensure(target)
                sent = time.monotonic()
                handshakes += sent - shaking
                attempt.in_flight = True
                job.stage = Stage.ASKED
                call = asyncio.ensure_future(stub.Prefill(req, timeout=self.args.prefill_timeout))
                await asyncio.wait((call, attempt.landed), return_when=asyncio.FIRST_COMPLETED)
                if attempt.committed_at is not None:
                    break  # landed and committed on the loop: the first token is on its way
                resp = await call
                attempt.in_flight = False
                if resp.error.code != "handshake_required":
                    break
                self.handshakes.forget(target.worker_id)
            if attempt.committed_at is None:
                if resp.error.code:
                    raise PrefillFailed(f"{resp.error.code}: {resp.error.message}")
                job.stage = Stage.RECEIVING
                reason = await asyncio.wait_for(attempt.landed, timeout=self.kv_wait_timeout)
                if reason is not None:
                    raise PrefillFailed(f"KV transfer failed: {reason}")
        except BaseException:
            if call is not None:
                call.cancel()  # D gave up on the attempt: P sees the call cancelled and drops it
            raise
        finally:
            renew.cancel()
        job.sent = sent
        job.setup = max(sent - job.began - handshakes, 0.0)  # decision, reservation (a retry: + Redis)
        if attempt.committed_at is not None:
            job.stage = Stage.COMMITTED
            self.metrics.remote_prefill_committed("landing")
            commit = time.monotonic() - attempt.committed_at  # the loop -> this thread
            self._keep(asyncio.ensure_future(self._record_answer(job, call, attempt.committed_at, commit)))
            return
        landed_at = time.monotonic()
        asked = req.params
        lp = logprob_from_proto(resp.first_token) if asked.HasField("logprobs") else None
        prompt_lps = None
        if asked.HasField("prompt_logprobs"):
            prompt_lps = prompt_logprobs_from_proto(resp.prompt_logprobs)
        if not await self._call(self.receiver.commit, job.rid, resp.first_token.token_id, lp, prompt_lps):
            raise RequestGone(job.rid)  # aborted while the KV was moving
        job.stage = Stage.COMMITTED
        self.metrics.remote_prefill_committed("answer")
        commit = time.monotonic() - landed_at
        self._observe(job, resp, landed_at, commit)

    async def _record_answer(self, job: RemotePrefillRequest, call, landed_at: float, commit: float) -> None:
        """P's answer to a prefill the loop already committed: only its timings are left to use."""
        attempt = job.attempt
        try:
            resp = await call
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            log.debug("answer to the committed prefill %s lost: %s", attempt.transfer_id, e)
            return
        finally:
            attempt.in_flight = False
        if resp.error.code:  # the KV had landed whole: what P says of it now changes nothing here
            log.debug("prefill %s answered %s after its KV landed", attempt.transfer_id, resp.error.code)
            return
        self._observe(job, resp, landed_at, commit)

    def _observe(
        self, job: RemotePrefillRequest, resp: pb.PrefillResponse, landed_at: float, commit: float
    ) -> None:
        """Feed one finished remote prefill to the cost estimate and the stage histograms (`setup`
        and `commit`: D's own stages around P's)."""
        wall = landed_at - job.sent
        fresh_tokens = len(job.tokens) - job.dst.num_cached_blocks * self.core.block_size
        queue, compute, transfer = resp.queue_seconds, resp.compute_seconds, resp.transfer_seconds
        self.cost.observe(wall, queue, compute, transfer, fresh_tokens)
        self.metrics.remote_prefill_stages(
            setup=job.setup,
            queue=queue,
            compute=compute,
            transfer=transfer,
            overhead=max(wall - queue - compute - transfer, 0.0),
            commit=commit,
        )
