"""The worker's gRPC service (grpc.aio): Generate, Prefill, Handshake, Abort, Health, Load.

A thin adapter: it checks and converts messages, and hands the work to the engine-loop thread
(`EngineLoop.call`, a future) or to the decode worker's remote prefill (`RemotePrefill`).
Outputs come back through per-request sinks (`OutputStream`); Redis is reached through
`StateLink`, whose calls never block serving when Redis is down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field

from disagg.proto import worker_pb2 as pb
from disagg.proto import worker_pb2_grpc as pb_grpc
from disagg.worker.engine.block_manager import NoFreeBlocksError
from disagg.worker.engine.resume import with_outputs
from disagg.worker.serving.args import ServingArgs
from disagg.worker.serving.attempt import PrefillAborted, PrefillFailed
from disagg.worker.serving.auth import INSECURE, InternalAuth
from disagg.worker.serving.convert import error, prefill_response, resumption, sampling_params
from disagg.worker.serving.core import WorkerCore
from disagg.worker.serving.engine_loop import EngineLoop
from disagg.worker.serving.metrics import ServingMetrics
from disagg.worker.serving.output_stream import OutputStream, count_prefix
from disagg.worker.serving.peer_identity import PeerIdentity
from disagg.worker.serving.prefill_job import PrefillJob, PrefillResult
from disagg.worker.serving.remote_prefill import RemotePrefill
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


def start_error(e: Exception) -> pb.Error:
    """What a Generate that could not start answers."""
    if isinstance(e, NoFreeBlocksError):
        return error("unavailable", f"KV cache full: {e}")
    if isinstance(e, PrefillFailed):
        return error("prefill_failed", str(e))
    return error("invalid_request", str(e))  # the engine refused the prompt (too long, bad token id)


def check_prefill(request: pb.PrefillRequest) -> pb.Error | None:
    if not 0 <= request.skip_leading_blocks < max(len(request.dst_block_ids), 1):
        return error(
            "invalid_request",
            f"skip_leading_blocks must be in [0, {len(request.dst_block_ids)}) "
            f"(the block of the last prompt token is always sent), got {request.skip_leading_blocks}",
        )
    return None


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
        self.live: dict[OutputStream, str] = {}  # Generate streams -> request id, for a drain to hand off
        # request id of each stream a drain handed off -> when: their new workers may pull its K/V
        self.handed_off: dict[str, float] = {}
        self._stubs = WorkerStubs(auth)
        self.identity = PeerIdentity(auth.peer_identity)
        # a colocated worker's targets hold a longer prefix than it does: it pulls one only when the
        # priced trip is cheaper than computing that prefix itself, whatever the placement mode
        args = (
            opts.args if opts.role == "decode" else dataclasses.replace(opts.args, prefill_placement="load")
        )
        self.remote = RemotePrefill(
            opts.worker_id, opts.address, args, opts.kv_wait_timeout, loop, core, state, metrics, self._stubs
        )  # fmt: skip

    async def _call(self, fn, *args):
        return await asyncio.wrap_future(self.loop.call(fn, *args))

    async def close(self) -> None:
        await self.remote.close()
        await self._stubs.close()

    def _refuse(self) -> pb.Error | None:
        if self.draining:
            return error("draining", f"worker {self.opts.worker_id} is shutting down")
        if not self.ready:
            return error("unavailable", f"worker {self.opts.worker_id} is not ready")
        return None

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
        stream = OutputStream(len(prompt), self.metrics, self.core.block_size, request.stream_interval)
        self.streams += 1
        self.live[stream] = rid
        try:
            try:
                served = await self._start(rid, prompt, request, params, stream)
            except (ValueError, NoFreeBlocksError, PrefillFailed) as e:
                yield pb.GenerateResponse(error=start_error(e))
                stream.finished = True
                return
            async for msg in stream.messages(served):
                yield msg
        finally:
            stream.first_sent.set()
            self.streams -= 1
            self.live.pop(stream, None)
            if not stream.finished:
                # client went away (or the stream broke): free the request without waiting
                self.loop.call(self.core.on_loop_abort, rid)
                self.metrics.request_finished("abort")

    async def _start(self, rid, prompt, request, params, stream: OutputStream) -> pb.ServedBy:
        """Queue the request here, or have a prefill worker prefill it first; who serves it.

        A moved stream (`resume`) is placed the same way with its outputs after the prompt; one a
        draining worker handed off pulls its K/V from that worker (`handoff_of`, its only
        target). When no prefill worker could do it, it is recomputed here."""
        served = pb.ServedBy(decode_worker=self.opts.worker_id)
        resume = resumption(request)
        add = (self.core.on_loop_add, rid, prompt, params, stream.sink, stream.arrival, resume)
        remote, reason = False, "no_prefill_worker"
        fits = len(with_outputs(prompt, resume)) + 1 < self.max_model_len
        if request.prefill_targets and self.opts.role != "prefill" and fits:
            try:
                if resume is not None and request.resume.handoff_of:
                    prefill_worker = await self.remote.pull(rid, prompt, request, params, resume, stream.sink)
                    reason = "handoff_pull"
                else:
                    prefill_worker, reason = await self.remote.prefill(
                        rid, prompt, request, params, stream.sink, stream.arrival, stream.first_sent, resume
                    )  # fmt: skip
                if prefill_worker is not None:
                    remote, served.prefill_worker, served.disaggregated = True, prefill_worker, True
            except PrefillAborted:
                raise
            except PrefillFailed as e:
                # no prefill worker could do it (dead, draining, gone from the registry): this
                # worker prefills the prompt itself rather than failing the request. The failed
                # attempts' blocks were freed and their sink ended the old queue.
                log.warning("remote prefill of %s failed (%s): prefilling locally", rid, e)
                reason = "remote_failed"
                stream.restart()
                await self._call(*add)
        else:
            await self._call(*add)
        if resume is not None and reason != "handoff_pull":
            reason = "resumed"  # counted apart from new requests, wherever it was prefilled
        self.metrics.disaggregation_decision(remote, reason)
        return served

    def hand_off(self) -> int:
        """End every running stream with `migrate`, for the router to resume it elsewhere; their
        K/V stays pullable (`handed_off`) while the drain lasts."""
        now = time.monotonic()
        for stream, rid in list(self.live.items()):
            self.handed_off[rid] = now
            stream.hand_off()
        return len(self.live)

    def pulls_expected(self) -> int:
        """Handed-off streams whose new worker may still pull their K/V (--handoff-pull-window)."""
        cutoff = time.monotonic() - self.opts.args.handoff_pull_window
        for rid in [r for r, at in self.handed_off.items() if at < cutoff]:
            del self.handed_off[rid]
        return len(self.handed_off)

    # ---- Prefill (prefill / both) ----------------------------------------------------------------
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        # the KV goes into the blocks of the decode worker the request names: only that worker may ask
        denied = self.identity.refusal(context, request.decode_worker_id, "Prefill")
        if denied is not None:
            return pb.PrefillResponse(error=error("permission_denied", denied))
        refused = self._refuse_prefill(request)
        if refused is not None:
            return pb.PrefillResponse(error=refused)
        try:
            params = sampling_params(request.params, prefill_only=True)
        except ValueError as e:
            return pb.PrefillResponse(error=error("invalid_request", str(e)))
        invalid = check_prefill(request)
        if invalid is not None:
            return pb.PrefillResponse(error=invalid)
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
            answer = await result
        except ValueError as e:
            return pb.PrefillResponse(error=error("invalid_request", str(e)))
        except asyncio.CancelledError:  # D went away or gave up: free what we hold
            self.loop.call(self.core.on_loop_abort, job.engine_id)
            raise
        finally:
            self.streams -= 1
            self.handed_off.pop(request.handoff_of, None)  # pulled (or failed): one pull a stream
        n = len(request.prompt_token_ids)
        if isinstance(answer, PrefillResult):
            self.metrics.ttft.observe(time.monotonic() - arrival)
            self.metrics.prompt_tokens.inc(n)
            count_prefix(self.metrics, self.core.block_size, n, answer.cached_tokens)
            self.metrics.request_finished("prefilled")
        return prefill_response(answer, n)

    def _refuse_prefill(self, request: pb.PrefillRequest) -> pb.Error | None:
        """Why a Prefill is refused (None: served). A pull of a stream this worker handed off is
        served while draining, and by a decode worker; any other pull is refused."""
        if request.handoff_of:
            self.pulls_expected()  # forget those past the window first
            if request.handoff_of in self.handed_off and self.ready:
                return None
            return error("prefill_failed", f"worker {self.opts.worker_id} holds no handed-off stream "
                         f"{request.handoff_of!r}")  # fmt: skip
        refused = self._refuse()
        if refused is None and self.opts.role == "decode":
            refused = error("invalid_request", "this is a decode worker: it does not serve Prefill")
        return refused

    async def Handshake(self, request: pb.HandshakeRequest, context) -> pb.HandshakeResponse:
        # the payload says where this worker's KV writes for request.worker_id go
        denied = self.identity.refusal(context, request.worker_id, "Handshake")
        if denied is not None:
            return pb.HandshakeResponse(
                worker_id=self.opts.worker_id, error=error("permission_denied", denied)
            )
        if not self.ready:
            return pb.HandshakeResponse(error=error("unavailable", "not ready"))
        try:
            await self._call(self.core.sender.add_peer, request.worker_id, bytes(request.payload))
        except Exception as e:  # IncompatiblePeer, bad payload
            return pb.HandshakeResponse(worker_id=self.opts.worker_id, error=error("invalid_request", str(e)))
        # our own payload is not sent back: only the peers we write to need theirs
        return pb.HandshakeResponse(worker_id=self.opts.worker_id)

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
