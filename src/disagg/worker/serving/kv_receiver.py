"""A decode worker's (D's) side of a remote prefill, on the engine-loop thread: blocks reserved
for a prompt, the transfers expected into them, quarantine, and the commit on landing.

KV writes are one-sided, so blocks a transfer may still write are never reused before it settles
(landed, or the sender's ABORT notice, which it sends only once its writes settled): D holds a
given-up transfer's blocks apart from the request (quarantine, keyed by the transfer id) until it
settles or a deadline passes, so the request can retry into fresh blocks or prefill locally under
the same id.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from disagg.worker.engine.llm_engine import Reservation
from disagg.worker.engine.outputs import RequestOutput, TokenLogprob
from disagg.worker.serving.args import ServingArgs
from disagg.worker.serving.engine_loop import SOON, yield_cpu
from disagg.worker.serving.held_blocks import hold
from disagg.worker.serving.metrics import ServingMetrics

log = logging.getLogger("disagg.worker.kv_receiver")

# how long the loop waits, after committing a landed remote prefill, for its first message to go
# out before it steps again (typically 0.2-0.4 ms; a stream that is slower just goes on later)
FIRST_TOKEN_HANDOFF_SECONDS = 0.002

Committed = Callable[[float], threading.Event | None]


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
    committed: Committed | None = None


def settles(reason: str | None) -> bool:
    """Whether a transfer's outcome means nothing more of it will land: it completed, or the
    sender aborted it (its ABORT notice follows its last write). A stall or a lost connection
    says nothing about writes still in flight."""
    return reason is None or reason.startswith("aborted")


def quarantine_key(transfer_id: str) -> str:
    return f"quarantine:{transfer_id}"


class KVReceiver:
    """Every method runs on the engine-loop thread. `sinks` is the worker's table of where each
    engine request's outputs go; `dispatch(out)` hands an output to its stream."""

    def __init__(
        self,
        engine,
        transport,
        metrics: ServingMetrics,
        sinks: dict,
        dispatch: Callable[[RequestOutput], None],
    ):
        self.engine = engine
        self.transport = transport
        self.metrics = metrics
        self.sinks = sinks
        self.dispatch = dispatch
        self.reserved: set[str] = set()  # request ids with reserved blocks not yet committed
        self.kv_waits: dict[str, KVWait] = {}  # transfer id -> waiter
        self.quarantined: dict[str, float] = {}  # transfer id given up on -> deadline of its held blocks
        self.quarantine_seconds = ServingArgs().quarantine_seconds()  # the worker sets its own

    # ---- reservations and expectations -------------------------------------------------------------
    def reserve(self, request_id: str, prompt_ids: list[int], params, sink, resume=None) -> Reservation:
        """Blocks for a remote prefill (`resume`: of a moved stream's prompt and outputs); the
        leading `num_cached_blocks` come from the prefix cache."""
        blocks = self.engine.reserve(request_id, prompt_ids, params, resume)
        self.reserved.add(request_id)
        self.sinks[request_id] = sink
        return blocks

    def reserve_expecting(
        self, request_id: str, prompt_ids: list[int], params, sink, transfer_id: str,
        done: Callable[[str | None], None], committed: Committed | None = None, resume=None,
    ) -> Reservation:  # fmt: skip
        """`reserve` and `expect` for its fresh blocks, in the same visit to the engine loop."""
        blocks = self.reserve(request_id, prompt_ids, params, sink, resume)
        self.expect(transfer_id, request_id, done, blocks.fresh_block_ids, committed)
        return blocks

    def expect(
        self,
        transfer_id: str,
        request_id: str,
        done: Callable[[str | None], None],
        block_ids: list[int],
        committed: Committed | None = None,
    ) -> bool:
        """Register interest in a transfer into `request_id`'s blocks `block_ids` (the only ones
        it may write); False if the request is gone. `committed`: see `KVWait`."""
        if request_id not in self.reserved:
            return False
        self.kv_waits[transfer_id] = KVWait(request_id, done, list(block_ids), committed=committed)
        self.transport.accept(transfer_id, block_ids)
        return True

    def end_attempt(self, transfer_id: str, sender_settled: bool) -> bool:
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

    def rereserve(self, request_id: str, prompt_ids: list[int], params, resume=None) -> Reservation | None:
        """Fresh blocks for the request's next attempt, its last ones being quarantined (None:
        the request is gone). Raises NoFreeBlocksError, the request then holding nothing."""
        if request_id not in self.reserved:
            return None
        self.engine.abort(request_id)
        try:
            return self.engine.reserve(request_id, prompt_ids, params, resume)
        except Exception:
            self.reserved.discard(request_id)
            raise

    def commit(
        self,
        request_id: str,
        token_id: int,
        logprob: TokenLogprob | None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> bool:
        """Start decoding a request whose KV landed, from its first token (a resumed one: from its
        last output, nothing to stream yet). False: it was aborted meanwhile, and the abort freed
        its blocks."""
        if request_id not in self.reserved:
            return False
        self.reserved.discard(request_id)
        out = self.engine.commit_remote_prefill(request_id, token_id, logprob, prompt_logprobs)
        if out is not None:
            self.dispatch(out)
        return True

    # ---- quarantine --------------------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """The request went away: its reservation ends, and the blocks its transfers may still
        land in are held apart. Whether it had a reservation."""
        if request_id not in self.reserved:
            return False
        self.reserved.discard(request_id)
        for tid in [t for t, w in self.kv_waits.items() if w.request_id == request_id and not w.quarantine]:
            waiter = self.kv_waits[tid]
            self._quarantine(tid)
            waiter.done("aborted")
        return True

    def _quarantine(self, transfer_id: str) -> None:
        """Hold the blocks `transfer_id` may write, apart from its request, until the transfer
        settles (lands, or the sender's ABORT notice arrives) or the quarantine deadline."""
        waiter = self.kv_waits[transfer_id]
        hold(self.engine.block_manager, quarantine_key(transfer_id), waiter.block_ids)
        self.kv_waits[transfer_id] = KVWait(waiter.request_id, lambda _r: None, waiter.block_ids, True)
        self.quarantined[transfer_id] = time.monotonic() + self.quarantine_seconds
        self.metrics.kv_quarantined.inc()

    def _unquarantine(self, transfer_id: str) -> None:
        if self.quarantined.pop(transfer_id, None) is not None:
            self.kv_waits.pop(transfer_id, None)
            self.transport.forget(transfer_id)
            self.engine.block_manager.unpin(quarantine_key(transfer_id))

    def reserved_blocks(self) -> int:
        """Blocks reserved for transfers: awaited, or held by a quarantine."""
        e, bm = self.engine, self.engine.block_manager
        n = sum(len(e.requests[r].block_ids) for r in self.reserved if r in e.requests)
        return n + sum(len(bm.pinned(quarantine_key(t)) or ()) for t in self.quarantined)

    def fail_all(self, reason: str) -> None:
        """The engine is unusable: every wait ends with `reason`."""
        for tid, waiter in list(self.kv_waits.items()):
            del self.kv_waits[tid]
            waiter.done(reason)
        self.reserved.clear()

    # ---- landing -----------------------------------------------------------------------------------
    def poll(self) -> bool | str:
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
        if token_id is None or not self.commit(waiter.request_id, token_id, None):
            return None
        sent = waiter.committed(time.monotonic())
        # The first token is in the asyncio thread's queue. That thread shares this one's core:
        # left to the scheduler, it ran 0.3-5 ms into the next step (a yield alone did not keep
        # it from being preempted before its write); waiting here gives it the core until then.
        if sent is None:
            return yield_cpu
        return lambda: sent.wait(FIRST_TOKEN_HANDOFF_SECONDS)
