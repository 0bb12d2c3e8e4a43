"""One generation of a request (one prompt, one sample) on its decode worker: the `Generate` call,
its messages relayed onto the request's event queue, and the moves of its live stream.

Before its first token, a decode worker found unreachable or draining is replaced by another
(`--decode-attempts`): nothing was sent to the client yet, and whatever it held is reclaimed by
its leases. After it, a stream whose worker dies, stops answering or hands it off mid-way moves to
another decode worker and resumes there from the tokens already relayed (`migration.py` builds
the resuming request), at most `--max-migrations` times.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from disagg.proto import worker_pb2
from disagg.worker.router.errors import APIError
from disagg.worker.router.fanout import ChoiceState
from disagg.worker.router.migration import (
    MIGRATION_SUFFIX,
    MOVABLE_ERRORS,
    finished_message,
    resumed_request,
    worth_pulling,
)
from disagg.worker.router.placement import Placement
from disagg.worker.router.policy import WorkerView
from disagg.worker.router.worker_errors import BROKEN, message_error, rpc_error, went_away
from disagg.worker.serving.metrics import ServingMetrics

log = logging.getLogger("disagg.router")


class Generation:
    """Its worker request, where it runs, and what was relayed of it (what a move resumes from).

    From its making until `release`, it is counted in flight on every decode worker it used, so
    that each routing decision weighs the ones taken before it; it is released when its worker
    stream ends, whether or not its client has read the output yet."""

    def __init__(
        self,
        state: ChoiceState,
        req: worker_pb2.GenerateRequest,
        decode: WorkerView,
        prompt_blocks: int,
        match: dict[str, int],
        *,
        placement: Placement,
        metrics: ServingMetrics,
        clock: Callable[[], float],
    ):
        self.state = state
        self.req = req
        self.decode = decode
        self.prompt_blocks = prompt_blocks
        self.match = match
        self.call = None  # the current worker's Generate call
        self.sent_ids: list[int] = []  # tokens relayed, over every worker
        self.sent_chars = 0  # characters of their text relayed
        self.migrations = 0
        self.moved_for: str | None = None  # why it last moved, until the new worker's first token
        self.moved_at: float | None = None
        self.last_token_at: float | None = None
        self._placement, self._pool, self._args = placement, placement.pool, placement.args
        self._metrics, self._clock = metrics, clock
        self.used: list[WorkerView] = []  # decode workers counted in flight for it
        self._count_on(decode)

    @property
    def original_id(self) -> str:
        return self.req.request_id.split(MIGRATION_SUFFIX, 1)[0]

    def release(self) -> None:
        """End its in-flight counts: once, when it ends on its worker or with its request."""
        used, self.used = self.used, []
        for d in used:
            self._pool.end(d.worker_id)

    def _count_on(self, decode: WorkerView) -> None:
        self.used.append(decode)
        self._pool.begin(decode.worker_id)

    def _taken(self) -> set[str]:
        return {u.worker_id for u in self.used}

    def relayed(self, msg, now: float) -> None:
        self.sent_ids.extend(msg.token_ids)
        self.sent_chars += len(msg.text)
        if msg.token_ids:
            if self.moved_for is not None:  # the first token after a move: the gap the client saw
                gap = now - (self.last_token_at if self.last_token_at is not None else self.moved_at)
                self._metrics.migrated(self.moved_for, "resumed", gap)
                self.moved_for = None
            self.last_token_at = now

    async def run(self, events: asyncio.Queue) -> None:
        """Relay the worker stream onto `events` as (self, message); then (self, None) when the
        stream ended, or (self, APIError) when it failed."""
        try:
            self.decode, self.call, msg = await self._start(self.req, self.decode)
            while True:
                broke = await self._relay(msg, events)
                if broke is None:
                    return
                msg = await self._move(broke, events)
                if msg is None:
                    return
        except APIError as e:
            events.put_nowait((self, e))
        except grpc.aio.AioRpcError as e:
            events.put_nowait((self, self._rpc_error(self.decode, e)))
        except asyncio.CancelledError:
            if self.call is not None:
                self.call.cancel()
                asyncio.ensure_future(self._abort(self.decode, self.req.request_id))
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # a sibling failed or the client left: the worker frees this generation's blocks
            # a call cancelled under us before any token: the generation still needs an answer
            self._pool.mark_failed(self.decode.worker_id)
            events.put_nowait((self, went_away(self.decode.worker_id)))

    async def _start(self, req: worker_pb2.GenerateRequest, decode: WorkerView):
        """Open the worker's stream and wait for its first message; (worker, call, message)."""
        attempts = self._args.decode_attempts
        for attempt in range(attempts):
            call = self._pool.stub(decode.address).Generate(req, timeout=self._args.request_timeout)
            try:
                first = await call.__aiter__().__anext__()
            except StopAsyncIteration:
                raise APIError(
                    500, "the worker closed the stream without output", code="worker_error"
                ) from None
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise self._rpc_error(decode, e) from e
                failure, why = self._rpc_error(decode, e), e.details()
            except asyncio.CancelledError:
                call.cancel()
                asyncio.ensure_future(self._abort(decode, req.request_id))
                raise
            else:
                if first.error.code != "draining":
                    return decode, call, first
                # it began draining after the router last polled it: out of rotation, try another
                self._pool.mark_failed(decode.worker_id)
                failure, why = message_error(first), "draining"
            lend = self._placement.lending(len(req.prompt_token_ids), req.params.max_tokens)
            _, alt = self._placement.choose(self.match, self.prompt_blocks, lend, self._taken())
            if attempt + 1 == attempts or alt is None:
                raise failure
            log.warning("decode worker %s %s; retrying on %s", decode.worker_id, why, alt.worker_id)
            decode = alt
            self._count_on(alt)
        raise AssertionError("unreachable")

    async def _relay(self, msg, events: asyncio.Queue) -> str | None:
        """Relay the current worker's messages from `msg` on. None when the stream is over (ended,
        or failed in a way another worker cannot fix); else why it broke, for `_move`: the worker's
        error code (a key of MOVABLE_ERRORS), or `unavailable` / `unresponsive` for a broken call."""
        it = self.call.__aiter__()
        finished = False  # its last message (finish reason, usage) is relayed: nothing to move
        movable = self.migrations < self._args.max_migrations
        try:
            while msg is not None:
                if msg.HasField("error"):
                    if msg.error.code in MOVABLE_ERRORS and movable:
                        return msg.error.code
                    events.put_nowait((self, msg))
                    return None
                self.relayed(msg, self._clock())
                events.put_nowait((self, msg))
                finished = finished or bool(msg.finish_reason)
                msg = await anext(it, None)
            events.put_nowait((self, None))
            return None
        except grpc.aio.AioRpcError as e:
            if e.code() in BROKEN:
                self._pool.mark_failed(self.decode.worker_id)
                if finished:  # it broke after the end was relayed: the generation is whole
                    events.put_nowait((self, None))
                    return None
                if movable:
                    return "unavailable"
            raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            # the call was cancelled under us: the generation still needs an answer
            self._pool.mark_failed(self.decode.worker_id)
            if finished:
                events.put_nowait((self, None))
                return None
            if movable:
                return "unresponsive"
            raise went_away(self.decode.worker_id) from None

    async def _move(self, broke: str, events: asyncio.Queue):
        """Re-place a stream broken for `broke` (what `_relay` said) on another decode worker,
        resuming from what was relayed; returns the new worker's first message, or None when the
        generation was finished here."""
        reason = MOVABLE_ERRORS.get(broke, broke)
        old = self.decode
        if self.call is not None:
            self.call.cancel()
        asyncio.ensure_future(self._abort(old, self.req.request_id))  # a frozen worker gets it later
        self.migrations += 1
        holder = None  # a worker that handed the stream off (draining) still holds its K/V
        if broke == "migrate" and worth_pulling(
            len(self.req.prompt_token_ids) + len(self.sent_ids), self._args.block_size
        ):
            holder = worker_pb2.PrefillTarget(worker_id=old.worker_id, address=old.address)
        req = resumed_request(
            self.req, self.original_id, self.migrations, self.sent_ids, self.sent_chars, holder
        )
        params = req.params
        done = (params.max_tokens and len(self.sent_ids) >= params.max_tokens) or (
            len(req.prompt_token_ids) + len(self.sent_ids) >= self._args.max_model_len
        )
        if done:  # the old worker sent the last token but not the end: nothing is left to generate
            events.put_nowait((self, finished_message(len(req.prompt_token_ids), len(self.sent_ids))))
            events.put_nowait((self, None))
            self._metrics.migrated(reason, "finished")
            return None
        lend = self._placement.lending(len(req.prompt_token_ids), params.max_tokens)
        views, alt = await self._placement.choose_or_wait(self.match, self.prompt_blocks, lend, self._taken())
        if alt is None:
            self._metrics.migrated(reason, "failed")
            raise APIError(503, f"worker {old.worker_id} went away and no other decode worker can take its "
                           "stream", code="worker_unavailable", retry_after=1)  # fmt: skip
        log.warning("stream %s: worker %s %s; resuming it on %s after %d tokens",
                    self.original_id, old.worker_id, reason, alt.worker_id, len(self.sent_ids))  # fmt: skip
        if holder is None:  # prompt and outputs are prefilled where the usual placement says
            req.prefill_targets.extend(self._placement.prefill_targets(views, alt, self.match))
        self._count_on(alt)
        self.req = req
        try:
            self.decode, self.call, first = await self._start(req, alt)
        except APIError:
            self._metrics.migrated(reason, "failed")
            raise
        self.moved_for, self.moved_at = reason, self._clock()
        return first

    def _rpc_error(self, decode: WorkerView, e: grpc.aio.AioRpcError) -> APIError:
        if e.code() in BROKEN:
            self._pool.mark_failed(decode.worker_id)
        return rpc_error(decode.worker_id, e)

    async def _abort(self, decode: WorkerView, request_id: str) -> None:
        try:
            await self._pool.stub(decode.address).Abort(
                worker_pb2.AbortRequest(request_id=request_id), timeout=2.0
            )
        except grpc.aio.AioRpcError:
            pass
