"""Scheduler logic without a model: each step's sampled token is faked."""

from __future__ import annotations

import pytest

from disagg.worker.engine.block_hash import block_hashes
from disagg.worker.engine.block_manager import BlockManager
from disagg.worker.engine.request import Request, RequestStatus
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.engine.scheduler import Scheduler


def make_req(rid: str, n_prompt: int, max_tokens: int = 4, base: int = 0) -> Request:
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens))


def run_step(sched: Scheduler, log: list | None = None):
    """One step: schedule, 'compute', append token 7 to every sampling request, finish on length."""
    out = sched.schedule()
    if out is None:
        return None
    assert out.num_tokens <= sched.max_num_batched_tokens or not out.is_prefill
    if not out.is_prefill:
        assert all(c.num_tokens == 1 for c in out.chunks)
    if log is not None:
        log.append(out)
    sched.advance(out)
    for c in out.chunks:
        if c.samples:
            req = c.request
            req.output_token_ids.append(7)
            if req.num_output_tokens >= req.params.max_tokens:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
    return out


def run_all(sched: Scheduler, log: list | None = None, limit: int = 10_000) -> int:
    steps = 0
    while sched.has_work():
        assert run_step(sched, log) is not None, "work left but nothing schedulable"
        steps += 1
        assert steps < limit
    return steps


def assert_all_free(bm: BlockManager):
    bm.check()
    assert bm.num_free_blocks == bm.num_blocks


def test_chunked_prefill_within_budget_then_decode():
    bm = BlockManager(32, 4)
    s = Scheduler(bm, max_num_batched_tokens=16)
    req = make_req("a", 50, max_tokens=3)
    s.add(req)
    log = []
    run_all(s, log)
    assert [(o.is_prefill, o.chunks[0].start, o.chunks[0].num_tokens) for o in log] == [
        (True, 0, 16),
        (True, 16, 16),
        (True, 32, 16),
        (True, 48, 2),  # the last chunk samples the first token
        (False, 50, 1),
        (False, 51, 1),
    ]
    assert [o.chunks[0].samples for o in log] == [False, False, False, True, True, True]
    assert req.output_token_ids == [7, 7, 7] and req.status == RequestStatus.FINISHED_LENGTH
    assert_all_free(bm)


def test_decode_alternates_with_long_prefills():
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_batched_tokens=8, mixed_steps=False)
    s.add(make_req("short", 2, max_tokens=10))
    run_step(s)  # prefill of "short"
    s.add(make_req("long", 40, max_tokens=2, base=100))
    log = []
    run_all(s, log)
    kinds = "".join("P" if o.is_prefill else "D" for o in log)
    # while "long" prefills in chunks of 8, "short" decodes every other step
    assert kinds.startswith("DPDPDPDPDP"), kinds
    assert_all_free(bm)


def test_max_num_seqs_limits_running():
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(5):
        s.add(make_req(f"r{i}", 5, max_tokens=3, base=10 * i))
    while s.has_work():
        run_step(s)
        assert len(s.running) <= 2
    assert_all_free(bm)


def test_prefix_hits_skip_cached_blocks_but_not_the_last_token():
    bm = BlockManager(32, 4)
    s = Scheduler(bm, max_num_batched_tokens=64)
    first = make_req("a", 12, max_tokens=1)
    s.add(first)
    run_all(s)
    assert bm.num_cached_blocks == 3  # 12 prompt tokens = 3 full blocks registered
    # same prompt again: all 12 are cached, yet the last block is recomputed for its logits
    again = make_req("b", 12, max_tokens=1)
    s.add(again)
    out = run_step(s)
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (8, 4)
    assert again.num_cached_tokens == 8
    # a longer prompt with the same first 12 tokens skips all three blocks
    longer = make_req("c", 14, max_tokens=1)
    s.add(longer)
    out = run_step(s)
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (12, 2)
    assert s.prefix_hit_tokens == 8 + 12
    assert_all_free(bm)


def test_preemption_newest_first_recomputes_with_outputs():
    bm = BlockManager(6, 4)  # 24 token slots
    s = Scheduler(bm, max_num_batched_tokens=64)
    old = make_req("old", 7, max_tokens=9)
    new = make_req("new", 7, max_tokens=9, base=50)
    s.add(old)
    s.add(new)
    log = []
    while not log or not any(o.preempted for o in log):
        run_step(s, log)
    out = log[-1]
    assert out.preempted == [new] and out.chunks[0].request is old
    assert new.status == RequestStatus.PREEMPTED and new.block_ids == [] and s.waiting[0] is new
    n_out = new.num_output_tokens
    assert n_out > 0
    at = len(log)
    run_all(s, log)
    # "new" recomputed prompt and outputs (minus what its still-cached blocks hold) in one
    # prefill chunk, then continued where it stopped
    chunk = next(c for o in log[at:] for c in o.chunks if c.request is new)
    assert chunk.end == 7 + n_out and chunk.samples and chunk.start % 4 == 0
    assert old.num_output_tokens == new.num_output_tokens == 9
    assert s.num_preemptions >= 1
    assert_all_free(bm)


def test_many_requests_through_a_small_cache_end_all_free():
    bm = BlockManager(10, 4)
    s = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=12)
    for i in range(12):
        s.add(make_req(f"r{i}", 3 + (5 * i) % 17, max_tokens=2 + i % 5, base=100 * i))
    run_all(s)
    assert_all_free(bm)


def test_abort_style_finish_from_each_queue():
    bm = BlockManager(16, 4)
    s = Scheduler(bm, max_num_batched_tokens=8)
    a, b = make_req("a", 10), make_req("b", 10, base=40)
    s.add(a)
    s.add(b)
    run_step(s)  # a takes the whole budget; b still waits
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    assert not s.has_work()
    assert_all_free(bm)


def test_reserve_commit_registers_remote_prompt_blocks():
    bm = BlockManager(16, 4)
    s = Scheduler(bm)
    req = make_req("remote", 9, max_tokens=3)
    blocks = s.reserve(req)
    assert len(blocks) == 3 and req.status == RequestStatus.RESERVED and not s.has_work()
    s.commit_reserved(req)
    req.output_token_ids.append(7)  # the first token, sampled by the prefill worker
    assert bm.lookup(block_hashes(req.prompt_token_ids, 4)) == blocks[:2]
    out = run_step(s)
    assert not out.is_prefill and out.chunks[0].start == 9
    run_all(s)
    assert_all_free(bm)


def test_prefilled_requests_pin_their_blocks():
    bm = BlockManager(16, 4)
    s = Scheduler(bm)
    req = make_req("p", 9, max_tokens=1)
    s.add(req)
    s.schedule()
    blocks = list(req.block_ids)
    s.finish(req, RequestStatus.FINISHED_PREFILLED)
    assert bm.pinned("p") == blocks and bm.num_free_blocks == 16 - 3
    bm.unpin("p")
    assert_all_free(bm)


def test_bad_limits():
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(BlockManager(4, 4), max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(BlockManager(4, 4), max_num_batched_tokens=0)


def test_mixed_steps_carry_every_decode_and_fill_the_rest_of_the_budget():
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_batched_tokens=8, mixed_steps=True)
    short = make_req("short", 2, max_tokens=10)
    s.add(short)
    run_step(s)  # prefill of "short"
    long = make_req("long", 40, max_tokens=2, base=100)
    s.add(long)
    log = []
    run_all(s, log)
    # while "long" prefills, every step also carries "short"'s next token, first in the batch
    prefilling = [o for o in log if any(c.request is long and not c.decode for c in o.chunks)]
    assert [[(c.request.request_id, c.num_tokens, c.decode) for c in o.chunks] for o in prefilling] == [
        [("short", 1, True), ("long", 7, False)]
    ] * 5 + [[("short", 1, True), ("long", 5, False)]]
    assert all(o.is_prefill for o in prefilling)
    # then both decode together in plain decode steps
    assert not log[len(prefilling)].is_prefill and len(log[len(prefilling)].chunks) == 2
    assert_all_free(bm)


@pytest.mark.parametrize("seed", range(4))
def test_mixed_steps_through_a_small_cache_never_preempt_a_scheduled_chunk(seed):
    import random

    rng = random.Random(seed)
    bm = BlockManager(12, 4)
    s = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=10, mixed_steps=True)
    pending = [make_req(f"r{i}", rng.randrange(2, 30), max_tokens=rng.randrange(1, 12), base=100 * i)
               for i in range(16)]  # fmt: skip
    steps = mixed = preempted = 0
    while pending or s.has_work():
        if pending and rng.random() < 0.5:  # arrivals while others run: mixed steps happen
            s.add(pending.pop())
        if not s.has_work():
            continue
        out = s.schedule()
        assert out is not None
        scheduled = {c.request.request_id for c in out.chunks}
        assert not scheduled & {r.request_id for r in out.preempted}
        mixed += out.is_prefill and out.chunks[0].decode
        preempted += len(out.preempted)
        for c in out.chunks:  # every chunk's K/V has its blocks
            assert len(c.request.block_ids) * 4 >= c.end
        s.advance(out)
        for c in out.chunks:
            if c.samples:
                c.request.output_token_ids.append(7)
                if c.request.num_output_tokens >= c.request.params.max_tokens:
                    s.finish(c.request, RequestStatus.FINISHED_LENGTH)
        steps += 1
        assert steps < 5000
    assert mixed and preempted, (mixed, preempted)  # the run exercised both
    assert_all_free(bm)
