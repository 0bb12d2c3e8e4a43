"""The worker's gRPC service (grpc.aio): Generate, Prefill, Handshake, Abort, Health, Load.

Handlers run on the asyncio loop and talk to the engine-loop thread only through
`EngineLoop.call` (a future) and per-request sinks (`call_soon_threadsafe` into an asyncio
queue). Redis is reached through `StateLink`, whose calls never block serving when Redis is down.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from disagg.proto import worker_pb2 as pb
from disagg.proto import worker_pb2_grpc as pb_grpc
from disagg.worker.engine.block_manager import NoFreeBlocksError
from disagg.worker.serving.args import ServingArgs
from disagg.worker.serving.auth import INSECURE, InternalAuth
from disagg.worker.serving.convert import (
    error,
    logprob_from_proto,
    logprob_to_proto,
    prompt_logprobs_from_proto,
    prompt_logprobs_to_proto,
    sampling_params,
)
from disagg.worker.serving.core import PrefillJob, WorkerCore
from disagg.worker.serving.disagg_policy import PrefillSite, choose_prefill_site
from disagg.worker.serving.engine_loop import EngineLoop
from disagg.worker.serving.metrics import ServingMetrics
from disagg.worker.serving.prefill_estimate import RemoteCost
from disagg.worker.serving.state_link import StateLink
from disagg.worker.serving.stubs import WorkerStubs

log = logging.getLogger("disagg.worker.servicer")


@dataclass
class ServingOptions:
    worker_id: str
    role: str  # prefill | decode | both
    model_name: str
    address: str  # our gRPC host:port as peers reach it
    args: ServingArgs = field(default_factory=ServingArgs)  # placement, timeouts, leases
    kv_wait_timeout: float = 60.0
    quantization: str = "none"  # the engine's weights, reported by Health
    dtype: str = ""


class PrefillFailed(Exception):
    pass


class RequestGone(Exception):
    """The request was aborted while its prefill was in progress."""


class PrefillAborted(PrefillFailed):
    """The request went away during its remote prefill: nothing to prefill locally."""


@dataclass
class Attempt:
    """One remote prefill attempt: its transfer id, the wait for its KV, what its cleanup must know."""

    transfer_id: str
    number: int  # 0: the first attempt (its Prefill call is not fenced by a generation)
    landed: asyncio.Future  # resolves with None once its KV landed, else the failure reason
    # a Prefill call is out and unanswered: P may still be writing into the attempt's blocks
    # (it answers, even with an error, only once its writes settled)
    in_flight: bool = False
    # may the engine loop commit the token P's FINAL notice carries once the KV landed (no
    # logprobs were asked: those come only in P's answer); when it did, the loop's time of it
    commit_on_landing: bool = False
    committed_at: float | None = None
    first_sent: threading.Event | None = None  # the request's first message went out

    @classmethod
    def new(
        cls,
        request_id: str,
        number: int,
        params: pb.SamplingParams,
        first_sent: threading.Event | None = None,
    ) -> Attempt:
        # unique even when a request id comes back: P remembers the transfer ids it refused
        transfer_id = f"{request_id}:{number}:{uuid.uuid4().hex[:8]}"
        commit = not (params.HasField("logprobs") or params.HasField("prompt_logprobs"))
        landed = asyncio.get_running_loop().create_future()
        return cls(transfer_id, number, landed, commit_on_landing=commit, first_sent=first_sent)

    @property
    def on_committed(self) -> Callable[[float], threading.Event | None] | None:
        """What the engine loop calls once it committed the landed prefill (None: it may not)."""
        return self._committed if self.commit_on_landing else None

    def _committed(self, at: float) -> threading.Event | None:
        """Called from the engine-loop thread, before `on_landed`; what to wait on before the
        loop's next step."""
        self.committed_at = at
        return self.first_sent

    def on_landed(self, reason: str | None) -> None:
        """Called from the engine-loop thread."""
        landed = self.landed
        landed.get_loop().call_soon_threadsafe(lambda: landed.done() or landed.set_result(reason))


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(
        self,
        opts: ServingOptions,
        loop: EngineLoop,
        core: WorkerCore,
        state: StateLink,
        metrics: ServingMetrics,
        max_model_len: int,
        auth: InternalAuth = INSECURE,
    ):
        self.opts = opts
        self.loop = loop
        self.core = core
        self.state = state
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.ready = False
        self.draining = False
        self.streams = 0  # Generate and Prefill calls in progress (drain waits for zero)
        self.remote_cost = RemoteCost()  # what a remote prefill costs beyond P's queue and compute
        self._stubs = WorkerStubs(auth)
        self._handshaken: set[str] = set()  # prefill workers whose KV handshake we hold
        self._handshake_locks: dict[str, asyncio.Lock] = {}
        self._settling: set[asyncio.Task] = set()  # transfer records finished after the first token

    # ---- plumbing ------------------------------------------------------------------------------
    async def _call(self, fn, *args):
        return await asyncio.wrap_future(self.loop.call(fn, *args))

    def _stub(self, address: str) -> pb_grpc.WorkerStub:
        return self._stubs.stub(address)

    async def close(self) -> None:
        if self._settling:
            await asyncio.wait(self._settling, timeout=5.0)
        await self._stubs.close()

    def _finish_record_later(self, rid: str, record: asyncio.Future) -> None:
        """Finish a transfer record without holding the first token back for Redis."""

        async def finish():
            await self.state.finish_transfer(rid, await asyncio.shield(record))

        task = asyncio.create_task(finish())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def _refuse(self) -> pb.Error | None:
        if self.draining:
            return error("draining", f"worker {self.opts.worker_id} is shutting down")
        if not self.ready:
            return error("unavailable", f"worker {self.opts.worker_id} is not ready")
        return None

    def _count_prefix(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Prefix-cache hit ratio of this worker, in full blocks of the prompt."""
        bs = self.core.block_size
        self.metrics.prefix_lookup(prompt_tokens // bs, cached_tokens // bs)

    # ---- Generate (decode / both; prefill when the router lends it a whole request) ---------------
    async def Generate(self, request: pb.GenerateRequest, context):
        # A prefill worker takes a whole request when the router's overflow policy sends it one
        # (policy.choose_decode): it prefills locally, as a colocated worker does.
        refused = self._refuse()
        if refused is not None:
            yield pb.GenerateResponse(error=refused)
            return
        rid = request.request_id or uuid.uuid4().hex
        prompt = list(request.prompt_token_ids)
        try:
            params = sampling_params(request.params)
        except ValueError as e:
            yield pb.GenerateResponse(error=error("invalid_request", str(e)))
            return
        aio = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(out):
            aio.call_soon_threadsafe(queue.put_nowait, out)

        arrival = time.monotonic()
        self.streams += 1
        finished = False
        served = pb.ServedBy(decode_worker=self.opts.worker_id)
        # set once the first message is written: an engine loop that committed a landed remote
        # prefill waits for it before its next step (see WorkerCore._commit_on_landing)
        first_sent = threading.Event()
        try:
            targets = list(request.prefill_targets)
            remote = False
            reason = "no_prefill_worker"
            try:
                if self.opts.role == "decode" and targets and len(prompt) + 1 < self.max_model_len:
                    began = time.monotonic()
                    attempt = Attempt.new(rid, 0, request.params, first_sent)
                    reason, dst = await self._place(rid, prompt, params, sink, arrival, targets[0], attempt)
                    remote = dst is not None
                else:
                    await self._call(self.core.on_loop_add, rid, prompt, params, sink, arrival)
                if remote:
                    try:
                        served.prefill_worker = await self._remote_prefill(
                            rid, prompt, request, params, targets, attempt, dst, began
                        )
                        served.disaggregated = True
                    except PrefillAborted:
                        raise
                    except PrefillFailed as e:
                        # no prefill worker could do it (dead, draining, gone from the registry):
                        # this worker prefills the prompt itself rather than failing the request.
                        # The failed attempts' blocks were freed and their sink ended the old queue.
                        log.warning("remote prefill of %s failed (%s): prefilling locally", rid, e)
                        queue = asyncio.Queue()
                        remote = False
                        await self._call(self.core.on_loop_add, rid, prompt, params, sink, arrival)
                self.metrics.disaggregation_decision(remote, reason)
            except ValueError as e:  # the engine refused the prompt (too long, bad token id)
                yield pb.GenerateResponse(error=error("invalid_request", str(e)))
                finished = True
                return
            except NoFreeBlocksError as e:
                yield pb.GenerateResponse(error=error("unavailable", f"KV cache full: {e}"))
                finished = True
                return
            except PrefillFailed as e:
                yield pb.GenerateResponse(error=error("prefill_failed", str(e)))
                finished = True
                return
            first = True
            last_token_at = None
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):  # the engine failed for good
                    finished = True
                    yield pb.GenerateResponse(error=error("engine_failed", str(out)))
                    self.metrics.request_finished("error")
                    return
                if out is None:  # aborted on the engine thread (Abort RPC, lease reclaim)
                    finished = True
                    yield pb.GenerateResponse(
                        finish_reason="abort", usage=pb.Usage(prompt_tokens=len(prompt))
                    )
                    self.metrics.request_finished("abort")
                    return
                msg = pb.GenerateResponse(token_ids=out.new_token_ids, text=out.new_text)
                if out.new_logprobs:
                    msg.logprobs.extend(logprob_to_proto(lp) for lp in out.new_logprobs)
                now = time.monotonic()
                if out.new_token_ids:
                    if last_token_at is None:
                        self.metrics.ttft.observe(now - arrival)
                    else:
                        self.metrics.itl.observe((now - last_token_at) / len(out.new_token_ids))
                    last_token_at = now
                    self.metrics.generation_tokens.inc(len(out.new_token_ids))
                if first:
                    msg.served_by.CopyFrom(served)
                    if out.prompt_logprobs is not None:
                        msg.prompt_logprobs.extend(prompt_logprobs_to_proto(out.prompt_logprobs))
                    first = False
                if out.finished:
                    finished = True
                    n_out = len(out.outputs[0].token_ids)
                    msg.finish_reason = out.finish_reason or "stop"
                    msg.usage.CopyFrom(
                        pb.Usage(
                            prompt_tokens=len(prompt),
                            completion_tokens=n_out,
                            cached_tokens=out.num_cached_tokens,
                        )
                    )
                    self.metrics.prompt_tokens.inc(len(prompt))
                    self._count_prefix(len(prompt), out.num_cached_tokens)
                    self.metrics.e2e.observe(now - arrival)
                    self.metrics.request_finished(msg.finish_reason)
                yield msg
                first_sent.set()
                if finished:
                    return
        finally:
            first_sent.set()
            self.streams -= 1
            if not finished:
                # client went away (or the stream broke): free the request without waiting
                self.loop.call(self.core.on_loop_abort, rid)
                self.metrics.request_finished("abort")

    async def _place(self, rid, prompt, params, sink, arrival, target, attempt: Attempt):
        """Price the prompt's prefill here and on the router's first choice of prefill worker, and
        act on it, in one engine-loop visit: (reason, the reservation of a remote prefill, or None
        when the request was queued here)."""
        decide = functools.partial(self._decide, len(prompt), target)
        expect = (attempt.transfer_id, attempt.on_landed, attempt.on_committed)
        try:
            return await self._call(
                self.core.on_loop_place, rid, prompt, params, sink, arrival, decide, expect
            )
        except asyncio.CancelledError:
            # The loop may have reserved and begun awaiting the transfer before the cancel took
            # effect. No Prefill went out, so nothing can land: end that wait as settled (queued
            # behind the placement), or the request's abort would quarantine its blocks for a
            # transfer that never comes. The abort in Generate frees the reservation.
            await self._call(self.core.on_loop_end_attempt, attempt.transfer_id, True)
            raise

    def _decide(
        self, prompt_len: int, target: pb.PrefillTarget, cached: int, local: PrefillSite, decoding: int
    ) -> tuple[bool, str]:
        """Remote or local, and why (runs on the engine loop, inside `on_loop_place`)."""
        uncached = prompt_len - cached
        if self.opts.args.prefill_placement == "threshold":
            remote = uncached >= self.opts.args.disagg_threshold
            return remote, "threshold" if remote else "short"
        decision = choose_prefill_site(
            uncached,
            self.opts.args.disagg_threshold,
            local,
            PrefillSite(target.queued_prefill_tokens, target.prefill_tokens_per_s or None),
            self.remote_cost.seconds(uncached),
            decoding,
            self.opts.args.disagg_busy_slack,
        )
        if decision.local_s is not None:
            log.debug(
                "prefill of %d uncached tokens: local %.1f ms, remote %.1f ms -> %s (%s)",
                uncached, decision.local_s * 1e3, decision.remote_s * 1e3,
                "remote" if decision.remote else "local", decision.reason,
            )  # fmt: skip
        return decision.remote, decision.reason

    async def _begin_transfer(self, rid: str, prefill_owner: str, blocks: list[int], previous: int) -> int:
        """`state.begin_transfer`, settled even when the request is cancelled meanwhile: the Redis
        write finishes in its thread regardless, and a record nobody finishes would hold the
        transfer's blocks in the index until its lease ran out."""
        begin = asyncio.ensure_future(
            self.state.begin_transfer(rid, prefill_owner, blocks, self.opts.args.lease_seconds, previous)
        )
        try:
            return await asyncio.shield(begin)
        except asyncio.CancelledError:
            gen = await begin
            await self.state.finish_transfer(rid, gen)
            raise

    async def _remote_prefill(self, rid, prompt, request, params, targets, current, dst, began) -> str:
        """Have a prefill worker fill the blocks `dst` reserved for attempt `current` (retrying
        once elsewhere), commit.

        Returns the prefill worker's id; raises PrefillFailed after the blocks were freed (or, for
        a failed attempt whose KV may still land, quarantined apart from the request).
        """
        # The first attempt's transfer record is written while its Prefill call is out, not before:
        # Redis stays off the first token's path. Nothing precedes that attempt to fence it against,
        # so P gets generation 0 (unchecked); a retry starts only after the failed attempt's Abort,
        # which P honours by transfer id, and carries its record's generation.
        blocks = dst.fresh_block_ids
        record = asyncio.ensure_future(self._begin_transfer(rid, targets[0].worker_id, blocks, 0))
        # `record` is awaited through shield() everywhere: the lease renewal awaits it too, and a
        # cancelled awaiter would otherwise cancel the record's task and every other awaiter's wait
        reasons = []
        try:
            for attempt, target in enumerate(targets[:2]):
                if attempt:
                    self.metrics.prefill_retries.inc()
                    previous = await asyncio.shield(record)
                    record = asyncio.ensure_future(
                        self._begin_transfer(rid, target.worker_id, dst.fresh_block_ids, previous)
                    )
                    current = Attempt.new(rid, attempt, request.params, current.first_sent)
                try:
                    if attempt and not await self._expect_kv(rid, current, dst):
                        raise RequestGone(rid)
                    await self._prefill_once(rid, prompt, request, target, dst, record, current, began)
                    self._finish_record_later(rid, record)
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
                        attempt + 1,
                        reason,
                    )
                    reasons.append(f"{target.worker_id}: {reason}")
                    if isinstance(e, grpc.aio.AioRpcError):
                        self._handshaken.discard(target.worker_id)
                    quarantined = await self._cleanup_attempt(target, current)
                    if quarantined and attempt + 1 < len(targets[:2]):
                        # its KV may still land in those blocks: the retry writes fresh ones
                        try:
                            dst = await self._call(self.core.on_loop_rereserve, rid, prompt, params)
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
            await self.state.finish_transfer(rid, await asyncio.shield(record))
            raise

    async def _cleanup_attempt(self, target, attempt: Attempt) -> bool:
        """Stop a failed attempt on P and let go of its KV wait; True when its blocks went to
        quarantine (P, slow rather than dead, may still write into them)."""
        settled = not attempt.in_flight
        try:  # P may still hold the prompt (slow, not dead): tell it to let go
            resp = await self._stub(target.address).Abort(
                pb.AbortRequest(request_id=attempt.transfer_id), timeout=1.0
            )
            # not found: P holds nothing of the attempt (never started, or its sends all done)
            # and refuses it if its Prefill arrives later; found: its ABORT notice settles it
            settled = settled or not resp.found
        except grpc.aio.AioRpcError as e:
            # nothing listens at P's address any more: the process, and its writes, are gone
            settled = settled or e.code() == grpc.StatusCode.UNAVAILABLE
        return await self._call(self.core.on_loop_end_attempt, attempt.transfer_id, settled)

    async def _prefill_once(
        self, rid, prompt, request, target, dst, record: asyncio.Future, attempt: Attempt, began: float
    ) -> None:
        """One attempt, the engine loop already waiting for its KV; `record` resolves to its
        transfer record's generation (the first attempt sends P generation 0 and does not wait).

        Returns once the request is committed: by the engine loop when the KV landed with the
        first token in P's FINAL notice (P's answer, with its timings, is then awaited apart), or
        here from P's answer."""
        transfer_id = attempt.transfer_id
        gen = await asyncio.shield(record) if attempt.number else 0
        stub = self._stub(target.address)
        req = pb.PrefillRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            params=request.params,
            decode_worker_id=self.opts.worker_id,
            dst_block_ids=dst,  # the whole prompt's blocks: P skips the leading cached ones itself
            transfer_generation=gen,
            transfer_id=transfer_id,
            skip_leading_blocks=dst.num_cached_blocks,
        )
        renew = asyncio.create_task(self._renew_lease(rid, record))
        call = None
        try:
            handshakes = 0.0  # once per peer, not a cost of each prompt: left out of the stages
            for _ in range(2):  # a second time only after a fresh handshake
                shaking = time.monotonic()
                await self._handshake(target)
                sent = time.monotonic()
                handshakes += sent - shaking
                attempt.in_flight = True
                call = asyncio.ensure_future(stub.Prefill(req, timeout=self.opts.args.prefill_timeout))
                await asyncio.wait((call, attempt.landed), return_when=asyncio.FIRST_COMPLETED)
                if attempt.committed_at is not None:
                    break  # landed and committed on the loop: the first token is on its way
                resp = await call
                attempt.in_flight = False
                if resp.error.code != "handshake_required":
                    break
                self._handshaken.discard(target.worker_id)
            if attempt.committed_at is None:
                if resp.error.code:
                    raise PrefillFailed(f"{resp.error.code}: {resp.error.message}")
                reason = await asyncio.wait_for(attempt.landed, timeout=self.opts.kv_wait_timeout)
                if reason is not None:
                    raise PrefillFailed(f"KV transfer failed: {reason}")
        except BaseException:
            if call is not None:
                call.cancel()  # D gave up on the attempt: P sees the call cancelled and drops it
            raise
        finally:
            renew.cancel()
        setup = max(sent - began - handshakes, 0.0)  # decision, reservation (a retry: + Redis)
        if attempt.committed_at is not None:
            self.metrics.remote_prefill_committed("landing")
            commit = time.monotonic() - attempt.committed_at  # the loop -> this thread
            task = asyncio.ensure_future(self._record_answer(call, attempt, sent, attempt.committed_at,
                                                             len(prompt), dst, setup, commit))  # fmt: skip
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)
            return
        landed_at = time.monotonic()
        lp = logprob_from_proto(resp.first_token) if request.params.HasField("logprobs") else None
        prompt_lps = None
        if request.params.HasField("prompt_logprobs"):
            prompt_lps = prompt_logprobs_from_proto(resp.prompt_logprobs)
        committed = await self._call(self.core.on_loop_commit, rid, resp.first_token.token_id, lp, prompt_lps)
        if not committed:
            raise RequestGone(rid)  # aborted while the KV was moving
        self.metrics.remote_prefill_committed("answer")
        commit = time.monotonic() - landed_at
        self._observe_remote(resp, sent, landed_at, len(prompt), dst, setup, commit)

    async def _record_answer(
        self, call, attempt: Attempt, sent, landed_at, prompt_len, dst, setup: float, commit: float
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
        self._observe_remote(resp, sent, landed_at, prompt_len, dst, setup, commit)

    def _observe_remote(
        self, resp, sent: float, landed_at: float, prompt_len: int, dst, setup: float, commit: float
    ) -> None:
        """Feed one finished remote prefill to the cost estimate and the stage histograms (`setup`
        and `commit`: D's own stages around P's)."""
        wall = landed_at - sent
        fresh_tokens = prompt_len - dst.num_cached_blocks * self.core.block_size
        self.remote_cost.observe(
            wall, resp.queue_seconds, resp.compute_seconds, resp.transfer_seconds, fresh_tokens
        )
        self.metrics.remote_prefill_stages(
            setup=setup,
            queue=resp.queue_seconds,
            compute=resp.compute_seconds,
            transfer=resp.transfer_seconds,
            overhead=max(wall - resp.queue_seconds - resp.compute_seconds - resp.transfer_seconds, 0.0),
            commit=commit,
        )

    async def _expect_kv(self, rid: str, attempt: Attempt, dst) -> bool:
        """Have the engine loop wait for a retry's KV in `dst`'s fresh blocks (False: request gone)."""
        expect = self.core.on_loop_expect_kv
        return await self._call(
            expect, attempt.transfer_id, rid, attempt.on_landed, dst.fresh_block_ids, attempt.on_committed
        )

    async def _renew_lease(self, rid: str, record: asyncio.Future) -> None:
        gen = await asyncio.shield(record)
        while True:
            await asyncio.sleep(self.opts.args.lease_seconds / 3)
            await self.state.renew_transfer(rid, gen, self.opts.args.lease_seconds)

    async def _handshake(self, target: pb.PrefillTarget) -> None:
        # one handshake per peer at a time: concurrent requests to a new peer wait for the first
        lock = self._handshake_locks.setdefault(target.worker_id, asyncio.Lock())
        async with lock:
            if target.worker_id in self._handshaken:
                return
            payload = await self._call(self.core.transport.handshake_payload)
            resp = await self._stub(target.address).Handshake(
                pb.HandshakeRequest(
                    worker_id=self.opts.worker_id, address=self.opts.address, payload=payload
                ),
                timeout=10.0,
            )
            if resp.error.code:
                raise PrefillFailed(f"handshake with {target.worker_id} refused: {resp.error.message}")
            self._handshaken.add(target.worker_id)

    # ---- Prefill (prefill / both) ----------------------------------------------------------------
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        refused = self._refuse()
        if refused is None and self.opts.role == "decode":
            refused = error("invalid_request", "this is a decode worker: it does not serve Prefill")
        if refused is not None:
            return pb.PrefillResponse(error=refused)
        try:
            params = sampling_params(request.params, prefill_only=True)
        except ValueError as e:
            return pb.PrefillResponse(error=error("invalid_request", str(e)))
        if not 0 <= request.skip_leading_blocks < max(len(request.dst_block_ids), 1):
            return pb.PrefillResponse(
                error=error(
                    "invalid_request",
                    f"skip_leading_blocks must be in [0, {len(request.dst_block_ids)}) "
                    f"(the block of the last prompt token is always sent), got {request.skip_leading_blocks}",
                )
            )
        if not await self.state.generation_current(request.request_id, request.transfer_generation):
            return pb.PrefillResponse(error=error("prefill_failed", "transfer generation moved on"))
        aio = asyncio.get_running_loop()
        result: asyncio.Future = aio.create_future()
        job = PrefillJob(
            engine_id=request.transfer_id or request.request_id,
            request_id=request.request_id,
            peer_id=request.decode_worker_id,
            dst_block_ids=list(request.dst_block_ids),
            skip_blocks=request.skip_leading_blocks,
            done=lambda r: aio.call_soon_threadsafe(lambda: result.done() or result.set_result(r)),
        )
        self.streams += 1
        arrival = time.monotonic()
        try:
            await self._call(self.core.on_loop_prefill, job, list(request.prompt_token_ids), params, arrival)
            r = await result
        except ValueError as e:
            return pb.PrefillResponse(error=error("invalid_request", str(e)))
        except asyncio.CancelledError:  # D went away or gave up: free what we hold
            self.loop.call(self.core.on_loop_abort, job.engine_id)
            raise
        finally:
            self.streams -= 1
        if "error" in r:
            code, message = r["error"]
            return pb.PrefillResponse(error=error(code, message))
        n = len(request.prompt_token_ids)
        self.metrics.ttft.observe(time.monotonic() - arrival)
        self.metrics.prompt_tokens.inc(n)
        self._count_prefix(n, r["cached_tokens"])
        self.metrics.request_finished("prefilled")
        first = pb.TokenLogprob(token_id=r["token_id"])
        if r["logprob"] is not None:
            first = logprob_to_proto(r["logprob"])
        return pb.PrefillResponse(
            prompt_logprobs=prompt_logprobs_to_proto(r["prompt_logprobs"] or []),
            first_token=first,
            prompt_tokens=n,
            cached_tokens=r["cached_tokens"],
            kv_bytes=r["kv_bytes"],
            transfer_seconds=r["seconds"],
            queue_seconds=r["queue_seconds"],
            compute_seconds=r["compute_seconds"],
        )

    async def Handshake(self, request: pb.HandshakeRequest, context) -> pb.HandshakeResponse:
        if not self.ready:
            return pb.HandshakeResponse(error=error("unavailable", "not ready"))
        try:
            await self._call(self.core.on_loop_add_peer, request.worker_id, bytes(request.payload))
            payload = await self._call(self.core.transport.handshake_payload)
        except Exception as e:  # IncompatiblePeer, bad payload
            return pb.HandshakeResponse(worker_id=self.opts.worker_id, error=error("invalid_request", str(e)))
        return pb.HandshakeResponse(worker_id=self.opts.worker_id, payload=payload)

    # ---- control ----------------------------------------------------------------------------------
    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        found = await self._call(self.core.on_loop_abort, request.request_id)
        return pb.AbortResponse(found=bool(found))

    async def Health(self, request, context) -> pb.HealthResponse:
        return pb.HealthResponse(
            ready=self.ready and self.loop.alive,
            worker_id=self.opts.worker_id,
            role=self.opts.role,
            model=self.opts.model_name,
            draining=self.draining,
            quantization=self.opts.quantization,
            dtype=self.opts.dtype,
        )

    async def Load(self, request, context) -> pb.LoadResponse:
        return self.core.load_response(self.opts.worker_id, self.opts.role)
