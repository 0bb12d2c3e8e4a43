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
from disagg.worker.engine.resume import with_outputs
from disagg.worker.serving.args import ServingArgs
from disagg.worker.serving.attempt import Attempt, PrefillAborted, PrefillFailed, RequestGone
from disagg.worker.serving.convert import logprob_from_proto, prompt_logprobs_from_proto
from disagg.worker.serving.disagg_policy import Placement, PrefillSite
from disagg.worker.serving.metrics import ServingMetrics
from disagg.worker.serving.peer_handshakes import PeerHandshakes
from disagg.worker.serving.prefill_estimate import RemoteCost
from disagg.worker.serving.transfer_record import TransferRecord

log = logging.getLogger("disagg.worker.remote_prefill")

MAX_ATTEMPTS = 2
# What P samples with for a resumed request: its first token is discarded (D goes on from the
# stream's own outputs), so none of the stream's sampling (grammar, penalties, logprobs) is needed
RESUMED_PREFILL_PARAMS = pb.SamplingParams(top_k=-1)


def prefill_params(request: pb.GenerateRequest, resume) -> pb.SamplingParams:
    return request.params if resume is None else RESUMED_PREFILL_PARAMS


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
        began = time.monotonic()
        targets = list(request.prefill_targets)[:MAX_ATTEMPTS]
        attempt = Attempt.new(rid, 0, prefill_params(request, resume), first_sent)
        reason, dst = await self._place(rid, prompt, params, sink, arrival, targets[0], attempt, resume)
        if dst is None:
            return None, reason
        worker = await self._attempts(rid, prompt, request, params, targets, attempt, dst, began, resume)
        return worker, reason

    async def _place(self, rid, prompt, params, sink, arrival, target, attempt: Attempt, resume=None):
        """Price the prompt's prefill here and on the router's first choice of prefill worker, and
        act on it, in one engine-loop visit: (reason, the reservation of a remote prefill, or None
        when the request was queued here)."""
        placement = self.placement(len(with_outputs(prompt, resume)), target)
        try:
            return await self._call(
                self.core.on_loop_place, rid, prompt, params, sink, arrival, placement, attempt.expect, resume
            )
        except asyncio.CancelledError:
            # The loop may have reserved and begun awaiting the transfer before the cancel took
            # effect. No Prefill went out, so nothing can land: end that wait as settled (queued
            # behind the placement), or the request's abort would quarantine its blocks for a
            # transfer that never comes. The caller's abort frees the reservation.
            await self._call(self.receiver.end_attempt, attempt.transfer_id, True)
            raise

    # ---- a handed-off stream ----------------------------------------------------------------------
    async def pull(self, rid, prompt, request: pb.GenerateRequest, params, resume, sink) -> str:
        """Pull the K/V of a stream a draining worker handed off (its prompt and the outputs it
        streamed: `request.prefill_targets[0]`, which samples nothing used here) into blocks
        reserved for the resumed request, which goes on from its last output once they landed.
        Returns the holder's id. Raises PrefillFailed when nothing could be pulled (the request
        then holds nothing here: the caller recomputes it) or PrefillAborted."""
        began = time.monotonic()
        attempt = Attempt.new(rid, 0, RESUMED_PREFILL_PARAMS)
        try:
            dst = await self._call(
                self.receiver.reserve_expecting, rid, prompt, params, sink, *attempt.expect, resume
            )
        except NoFreeBlocksError as e:
            raise PrefillFailed(f"no free blocks to pull into: {e}") from None
        except asyncio.CancelledError:
            await self._call(self.receiver.end_attempt, attempt.transfer_id, True)
            raise
        targets = list(request.prefill_targets[:1])
        return await self._attempts(rid, prompt, request, params, targets, attempt, dst, began, resume)

    # ---- attempts ---------------------------------------------------------------------------------
    async def _attempts(
        self, rid, prompt, request, params, targets, current: Attempt, dst, began, resume=None
    ) -> str:
        """Have a prefill worker fill the blocks `dst` reserved for attempt `current` (retrying
        once elsewhere), commit. Returns the prefill worker's id; raises PrefillFailed after the
        blocks were freed (or, for a failed attempt whose KV may still land, quarantined apart
        from the request)."""
        # Nothing precedes the first attempt to fence it against, so P gets generation 0
        # (unchecked); a retry starts only after the failed attempt's Abort, which P honours by
        # transfer id, and carries its record's generation.
        record = TransferRecord(self.state, rid, self.args.lease_seconds, self.background)
        record.begin(targets[0].worker_id, dst.fresh_block_ids)
        reasons = []
        try:
            for number, target in enumerate(targets):
                if number:
                    self.metrics.prefill_retries.inc()
                    record.begin(target.worker_id, dst.fresh_block_ids, await record.generation())
                    current = Attempt.new(rid, number, prefill_params(request, resume), current.first_sent)
                try:
                    if number and not await self._expect_kv(rid, current, dst):
                        raise RequestGone(rid)
                    await self._prefill_once(
                        rid, prompt, request, target, dst, record, current, began, resume
                    )
                    record.finish_later()
                    return target.worker_id
                except asyncio.CancelledError:
                    await self._cleanup_attempt(target, current)
                    raise
                except RequestGone:
                    # aborted meanwhile (Abort RPC, lease reclaim): the abort owns the blocks now
                    await self._cleanup_attempt(target, current)
                    raise PrefillAborted(f"request {rid} was aborted") from None
                except (PrefillFailed, grpc.aio.AioRpcError, TimeoutError) as e:
                    reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                    log.warning(
                        "prefill of %s on %s failed (attempt %d): %s",
                        rid,
                        target.worker_id,
                        number + 1,
                        reason,
                    )
                    reasons.append(f"{target.worker_id}: {reason}")
                    if isinstance(e, grpc.aio.AioRpcError):
                        self.handshakes.forget(target.worker_id)
                    quarantined = await self._cleanup_attempt(target, current)
                    if quarantined and number + 1 < len(targets):
                        # its KV may still land in those blocks: the retry writes fresh ones
                        try:
                            dst = await self._call(self.receiver.rereserve, rid, prompt, params, resume)
                        except NoFreeBlocksError:
                            reasons.append("no free blocks to retry into")
                            break
                        if dst is None:
                            raise PrefillAborted(f"request {rid} was aborted") from None
            await self._call(self.core.on_loop_abort, rid)
            raise PrefillFailed("; ".join(reasons) or "no prefill worker available")
        except BaseException:
            # every way out but success (which finishes it after the first token) finishes the
            # latest attempt's record, a cancel between attempts included: a record left behind
            # holds the transfer's blocks in the index until its lease runs out
            await record.finish()
            raise

    async def _expect_kv(self, rid: str, attempt: Attempt, dst) -> bool:
        """Have the engine loop wait for a retry's KV in `dst`'s fresh blocks (False: request gone)."""
        tid, landed, committed = attempt.expect
        return await self._call(self.receiver.expect, tid, rid, landed, dst.fresh_block_ids, committed)

    async def _cleanup_attempt(self, target, attempt: Attempt) -> bool:
        """Stop a failed attempt on P and let go of its KV wait; True when its blocks went to
        quarantine (P, slow rather than dead, may still write into them)."""
        settled = not attempt.in_flight
        try:  # P may still hold the prompt (slow, not dead): tell it to let go
            resp = await self._stubs.stub(target.address).Abort(
                pb.AbortRequest(request_id=attempt.transfer_id), timeout=1.0
            )
            # not found: P holds nothing of the attempt (never started, or its sends all done)
            # and refuses it if its Prefill arrives later; found: its ABORT notice settles it
            settled = settled or not resp.found
        except grpc.aio.AioRpcError as e:
            # nothing listens at P's address any more: the process, and its writes, are gone
            settled = settled or e.code() == grpc.StatusCode.UNAVAILABLE
        return await self._call(self.receiver.end_attempt, attempt.transfer_id, settled)

    async def _prefill_once(
        self,
        rid,
        prompt,
        request,
        target,
        dst,
        record: TransferRecord,
        attempt: Attempt,
        began: float,
        resume=None,
    ) -> None:
        """One attempt, the engine loop already waiting for its KV (the first attempt sends P
        generation 0 and does not wait for its record).

        Returns once the request is committed: by the engine loop when the KV landed with the
        first token in P's FINAL notice (P's answer, with its timings, is then awaited apart), or
        here from P's answer."""
        gen = await record.generation() if attempt.number else 0
        stub = self._stubs.stub(target.address)
        tokens = with_outputs(prompt, resume)
        req = pb.PrefillRequest(
            request_id=rid,
            prompt_token_ids=tokens,
            params=prefill_params(request, resume),
            decode_worker_id=self.worker_id,
            dst_block_ids=dst,  # the whole prompt's blocks: P skips the leading cached ones itself
            transfer_generation=gen,
            transfer_id=attempt.transfer_id,
            skip_leading_blocks=dst.num_cached_blocks,
            handoff_of=request.resume.handoff_of if resume is not None else "",
        )
        renew = record.renew()
        call = None
        try:
            handshakes = 0.0  # once per peer, not a cost of each prompt: left out of the stages
            for _ in range(2):  # a second time only after a fresh handshake
                shaking = time.monotonic()
                await self.handshakes.ensure(target)
                sent = time.monotonic()
                handshakes += sent - shaking
                attempt.in_flight = True
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
                reason = await asyncio.wait_for(attempt.landed, timeout=self.kv_wait_timeout)
                if reason is not None:
                    raise PrefillFailed(f"KV transfer failed: {reason}")
        except BaseException:
            if call is not None:
                call.cancel()  # D gave up on the attempt: P sees the call cancelled and drops it
            raise
        finally:
            renew.cancel()
        setup = max(sent - began - handshakes, 0.0)  # decision, reservation (a retry: + Redis)
        fresh_tokens = len(tokens) - dst.num_cached_blocks * self.core.block_size
        if attempt.committed_at is not None:
            self.metrics.remote_prefill_committed("landing")
            commit = time.monotonic() - attempt.committed_at  # the loop -> this thread
            self._keep(asyncio.ensure_future(
                self._record_answer(call, attempt, sent, attempt.committed_at, fresh_tokens, setup, commit)
            ))  # fmt: skip
            return
        landed_at = time.monotonic()
        asked = req.params
        lp = logprob_from_proto(resp.first_token) if asked.HasField("logprobs") else None
        prompt_lps = None
        if asked.HasField("prompt_logprobs"):
            prompt_lps = prompt_logprobs_from_proto(resp.prompt_logprobs)
        if not await self._call(self.receiver.commit, rid, resp.first_token.token_id, lp, prompt_lps):
            raise RequestGone(rid)  # aborted while the KV was moving
        self.metrics.remote_prefill_committed("answer")
        commit = time.monotonic() - landed_at
        self._observe(resp, sent, landed_at, fresh_tokens, setup, commit)

    async def _record_answer(
        self, call, attempt: Attempt, sent, landed_at, fresh_tokens: int, setup: float, commit: float
    ) -> None:
        """P's answer to a prefill the loop already committed: only its timings are left to use."""
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
        self._observe(resp, sent, landed_at, fresh_tokens, setup, commit)

    def _observe(
        self,
        resp: pb.PrefillResponse,
        sent: float,
        landed_at: float,
        fresh_tokens: int,
        setup: float,
        commit: float,
    ) -> None:
        """Feed one finished remote prefill to the cost estimate and the stage histograms (`setup`
        and `commit`: D's own stages around P's)."""
        wall = landed_at - sent
        queue, compute, transfer = resp.queue_seconds, resp.compute_seconds, resp.transfer_seconds
        self.cost.observe(wall, queue, compute, transfer, fresh_tokens)
        self.metrics.remote_prefill_stages(
            setup=setup,
            queue=queue,
            compute=compute,
            transfer=transfer,
            overhead=max(wall - queue - compute - transfer, 0.0),
            commit=commit,
        )
