"""Which tokens of which requests the next forward pass computes.

Two queues: `waiting` (FIFO; preempted requests go back to its front) and `running`
(admitted, holding blocks, ordered oldest first). A step computes

  * decode work: one token for every running request that has exactly one left; and/or
  * prefill work: chunks of uncomputed tokens within `max_num_batched_tokens`: first the
    running requests still in prefill, then newly admitted waiting requests.

With `mixed_steps` (the default, `EngineArgs.mixed_steps`) every step carries all the decode
work and fills the rest of the token budget with prefill chunks, decode tokens first in the
batch, as vLLM's scheduler does: decoding never waits for a prompt and prompts progress every
step, for the price of one pass over the weights. Without it, when both kinds of work exist the steps
alternate, so a stream of long prompts never starves decoding and decoding never starves
admission. Admission takes the longest cached
prefix of full blocks (always leaving at least the last token to compute, whose logits
are needed), then the blocks that follow it in the lower KV tiers (`tiers`, when the engine has
them: copied back into fresh blocks instead of recomputed). When a running request needs a block
and none is free, the newest running request is preempted: its blocks are freed and it
recomputes everything later.

Pure logic over `BlockManager`, `Request` and the tiers' find / restore: no tensors, no model.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence, Sized
from dataclasses import dataclass, field
from typing import Protocol

from disagg.worker.engine.args import EngineArgs
from disagg.worker.engine.block_manager import BlockManager, NoFreeBlocksError
from disagg.worker.engine.request import Request, RequestStatus


class LowerTiers(Protocol):
    """What admission needs of the KV tiers below the cache (`tiers.KVTiers`)."""

    def find(self, hashes: Sequence[int], token_ids: Sequence[int], first: int, last: int) -> Sized: ...

    def restore(self, hit, block_ids: Sequence[int]) -> int: ...

    def release(self, hit) -> None: ...


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first position computed this step (= num_computed_tokens when scheduled)
    num_tokens: int
    decode: bool = False  # a running request's one next token (leading chunks of a mixed step)
    # whether this chunk reaches the end of the sequence, so a token is sampled after it
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.end == self.request.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    is_prefill: bool  # any prefill chunk in the step (decode chunks may lead it: a mixed step)
    chunks: list[ScheduledChunk]
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = EngineArgs.max_num_seqs,
        max_num_batched_tokens: int = EngineArgs.max_num_batched_tokens,
        watermark: float = 0.01,
        mixed_steps: bool = EngineArgs.mixed_steps,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.mixed_steps = mixed_steps
        # blocks kept free when admitting next to running requests, so that admission does
        # not immediately force a preemption on the next decode step
        self.watermark_blocks = max(1, int(watermark * block_manager.num_blocks))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved: dict[str, Request] = {}
        self.tiers: LowerTiers | None = None
        self._last_was_prefill = False
        self._arrivals = 0
        # statistics
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.tier_hit_tokens = 0  # of prefix_hit_tokens, those restored from the lower tiers

    # ---- queues -----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self._arrivals += 1
        req.arrival = self._arrivals
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take `req` out of the queues and release its blocks (prefilled: pin them)."""
        assert status.finished
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        elif req.status == RequestStatus.RESERVED:
            del self.reserved[req.request_id]
        req.status = status
        if status == RequestStatus.FINISHED_PREFILLED:
            self.bm.pin(req.request_id, req.block_ids)
        elif req.block_ids:
            self.bm.free(req.block_ids)
        req.block_ids = []

    # ---- remote prefill (decode side of disaggregation) ------------------------------
    def reserve(self, req: Request) -> list[int]:
        """Hold blocks for `req`'s prompt, whose K/V another worker will write; returns their ids
        in order (raises NoFreeBlocksError, holding nothing, when the cache is full).

        Leading full blocks already in the prefix cache are shared, not allocated: their K/V is
        in place, so the sender skips `req.num_cached_tokens // block_size` of them. The block of
        the last prompt token is always fresh: the prefill side computes that token to sample the
        first output token. A resumed request (outputs already set) reserves for its prompt and
        outputs together.
        """
        bs = self.block_size
        hashes = req.update_block_hashes(bs)
        max_hit = (req.num_tokens - 1) // bs
        hits = self.bm.lookup(hashes[:max_hit], req.all_token_ids)
        self.bm.acquire(hits)  # first, so that allocating the rest cannot evict them
        below = self._find_below(req, len(hits), max_hit)
        try:
            fresh = self.bm.allocate(self.bm.blocks_for(req.num_tokens) - len(hits))
        except NoFreeBlocksError:
            self.bm.free(hits)
            if below is not None:
                self.tiers.release(below)
            raise
        req.block_ids = hits + fresh
        restored = self._restore(req, below, len(hits))
        # commit offers only the written blocks to the cache
        req.num_registered_blocks = len(hits) + restored
        req.num_cached_tokens = (len(hits) + restored) * bs
        self.prefix_query_tokens += req.num_tokens
        self.prefix_hit_tokens += req.num_cached_tokens
        self._arrivals += 1
        req.arrival = self._arrivals
        req.status = RequestStatus.RESERVED
        self.reserved[req.request_id] = req
        return list(req.block_ids)

    def commit_reserved(self, req: Request) -> None:
        """The prompt's K/V has arrived: the request runs from here as if it prefilled locally. A
        resumed request runs as if it were decoding: its last output is the next token computed."""
        assert req.status == RequestStatus.RESERVED
        del self.reserved[req.request_id]
        req.num_computed_tokens = req.num_tokens - (1 if req.output_token_ids else 0)
        self._register_computed_blocks(req)
        req.status = RequestStatus.RUNNING
        self._insert_running(req)

    # ---- scheduling -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput | None:
        if self.mixed_steps:
            out = self._schedule_mixed()
            return out if out.chunks else None
        has_decode = any(r.num_uncomputed == 1 for r in self.running)
        if has_decode and self._last_was_prefill:
            out = self._schedule_decode()
        else:
            out = self._schedule_prefill()
            if not out.chunks and has_decode:
                out = self._schedule_decode()
        if not out.chunks:
            return None
        self._last_was_prefill = out.is_prefill
        return out

    def _schedule_mixed(self) -> SchedulerOutput:
        """All the decode work, then prefill chunks in the rest of the budget. The prefill part
        preempts nobody when decode chunks are scheduled (a victim could be one of them): a
        prompt that does not fit waits for decoding requests to finish and free blocks."""
        out = self._schedule_decode()
        budget = self.max_num_batched_tokens - len(out.chunks)
        if out.preempted or budget <= 0:
            return out
        prefill = self._schedule_prefill(budget, preempt=not out.chunks)
        if not prefill.chunks:
            return out
        return SchedulerOutput(
            is_prefill=True, chunks=out.chunks + prefill.chunks, preempted=prefill.preempted
        )

    def _schedule_prefill(self, budget: int | None = None, preempt: bool = True) -> SchedulerOutput:
        out = SchedulerOutput(is_prefill=True, chunks=[])
        budget = self.max_num_batched_tokens if budget is None else budget
        # 1. running requests part-way through their prompt (or a recomputation)
        for req in list(self.running):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING or req.num_uncomputed <= 1:
                continue
            n = self._fit(req, min(req.num_uncomputed, budget), out, preempt)
            if n:
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
                budget -= n
        # 2. admit waiting requests while budget, sequence slots and blocks last
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = self._admit(req, budget)
            if n == 0:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self._insert_running(req)
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        return out

    def _schedule_decode(self) -> SchedulerOutput:
        out = SchedulerOutput(is_prefill=False, chunks=[])
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING or req.num_uncomputed != 1:
                continue
            if self._fit(req, 1, out):
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, 1, decode=True))
        return out

    def _admit(self, req: Request, budget: int) -> int:
        """Give a waiting request its cached prefix and blocks for its first chunk; returns the
        chunk length, or 0 (nothing taken) when its blocks do not fit now."""
        bs = self.block_size
        hashes = req.update_block_hashes(bs)
        # the last token is always computed: its logits give the next token; prompt logprobs need
        # the logits of every prompt position, so such a request takes nothing from the cache
        max_hit = 0 if req.needs_prompt_logprobs else (req.num_tokens - 1) // bs
        hits = self.bm.lookup(hashes[:max_hit], req.all_token_ids)
        self.bm.acquire(hits)
        spare = self.bm.num_free_blocks - (self.watermark_blocks if self.running else 0)
        # blocks restored from below need cache blocks too: leave room for one block of compute
        below = self._find_below(req, len(hits), min(max_hit, len(hits) + max(spare - 1, 0)))
        num_below = 0 if below is None else len(below)
        num_cached = (len(hits) + num_below) * bs
        n = min(req.num_tokens - num_cached, budget)
        n = min(n, (len(hits) + spare) * bs - num_cached)
        if n <= 0:
            self.bm.free(hits)
            if below is not None:
                self.tiers.release(below)
            return 0
        end = num_cached + n
        req.block_ids = hits + self.bm.allocate(self.bm.blocks_for(end) - len(hits))
        restored = self._restore(req, below, len(hits))
        num_cached = (len(hits) + restored) * bs
        n = min(end - num_cached, budget)  # a block that could not be restored is computed instead
        req.num_computed_tokens = num_cached
        req.num_registered_blocks = len(hits) + restored
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_cached
        self.prefix_query_tokens += req.num_tokens
        self.prefix_hit_tokens += num_cached
        return n

    def _find_below(self, req: Request, first: int, last: int):
        """The prompt's blocks first.. (before `last`) that the lower tiers hold, or None."""
        if self.tiers is None or first >= last:
            return None
        below = self.tiers.find(req.block_hashes, req.all_token_ids, first, last)
        if not len(below):
            self.tiers.release(below)
            return None
        return below

    def _restore(self, req: Request, below, first: int) -> int:
        """Copy what `below` found into the request's blocks first, first+1, ... and offer them to
        the prefix cache; returns how many were restored."""
        if below is None:
            return 0
        restored = self.tiers.restore(below, req.block_ids[first : first + len(below)])
        bs, tokens = self.block_size, req.all_token_ids
        for i in range(first, first + restored):
            self.bm.register(req.block_ids[i], req.block_hashes[i], tokens[i * bs : (i + 1) * bs])
        self.tier_hit_tokens += restored * bs
        return restored

    def _fit(self, req: Request, want: int, out: SchedulerOutput, preempt: bool = True) -> int:
        """Make room for `want` more tokens of running `req`, shrinking the chunk to the free
        blocks or, when not even one token fits, preempting the newest running requests
        (possibly `req` itself; with `preempt` off, nobody: 0). Returns the number of tokens that
        fit (0 if `req` was preempted)."""
        while True:
            capacity = (len(req.block_ids) + self.bm.num_free_blocks) * self.block_size
            n = min(want, capacity - req.num_computed_tokens)
            if n > 0:
                need = self.bm.blocks_for(req.num_computed_tokens + n) - len(req.block_ids)
                if need > 0:
                    req.block_ids += self.bm.allocate(need)
                return n
            if not preempt:
                return 0
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return 0

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.bm.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        out.preempted.append(req)

    def _insert_running(self, req: Request) -> None:
        keys = [r.arrival for r in self.running]
        self.running.insert(bisect.bisect(keys, req.arrival), req)

    # ---- after the forward pass -------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """Mark the scheduled tokens computed and offer newly full blocks to the prefix cache."""
        for chunk in out.chunks:
            req = chunk.request
            assert req.num_computed_tokens == chunk.start, "request changed between schedule and advance"
            req.num_computed_tokens = chunk.end
            self._register_computed_blocks(req)

    def _register_computed_blocks(self, req: Request) -> None:
        n_full = req.num_computed_tokens // self.block_size
        if n_full <= req.num_registered_blocks:
            return
        hashes = req.update_block_hashes(self.block_size)
        tokens, bs = req.all_token_ids, self.block_size
        for i in range(req.num_registered_blocks, n_full):
            self.bm.register(req.block_ids[i], hashes[i], tokens[i * bs : (i + 1) * bs])
        req.num_registered_blocks = n_full
