"""No block is reused while a KV transfer may still write into it: the prefill side sends its
ABORT notice (and frees its source blocks) only once the transfer's sends settled, the decode
side quarantines the blocks of a failed attempt that has not settled and retries into fresh ones.

WorkerCore over a real engine; the transport is a `KVTransport` whose sends stay pending until
the test settles them (the one-sided writes of a slow prefill worker)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from disagg.proto import kv_transfer_pb2 as pb
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.kv_transfer.base import KVTransport
from disagg.worker.kv_transfer.handle import DONE, PENDING, TransferHandle, finished_handle
from disagg.worker.kv_transfer.layout import KVLayout

BLOCK = 16


class HeldTransport(KVTransport):
    """Sends stay pending until the test settles them; notices are recorded as sent."""

    backend = "held"

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout):
        super().__init__(kv_cache, layout, "held")
        self.posted: list[TransferHandle] = []
        self.notices: list[pb.KVNotice] = []

    def handshake_payload(self) -> bytes:
        return b""

    def add_peer(self, peer_id, payload, address=None) -> None:
        self._peer_layouts[peer_id] = self.layout

    def remove_peer(self, peer_id) -> None:
        self._peer_layouts.pop(peer_id, None)

    def _post(self, peer_id, transfer_id, layers, src, dst, src_regions, dst_regions, timeout):
        handle = TransferHandle(self.backend, peer_id, transfer_id, len(src_regions), timeout,
                                on_error=self._on_send_error)  # fmt: skip
        self.posted.append(handle)
        return handle

    def _notify(self, peer_id, notice, timeout):
        self.notices.append(notice)
        return finished_handle(self.backend, peer_id, notice.request_id)

    def kinds(self, transfer_id: str) -> list[int]:
        return [n.kind for n in self.notices if n.request_id == transfer_id]


def _transport(kv_cache: torch.Tensor | None = None) -> HeldTransport:
    """Over an engine's cache, or a small one of its own."""
    kv_cache = torch.zeros(2, 8, 2, BLOCK, 1, 4) if kv_cache is None else kv_cache
    t = HeldTransport(kv_cache, KVLayout.from_tensor(kv_cache, "m"))
    t.add_peer("decode-0", b"")
    return t


def test_abort_notice_waits_until_every_posted_send_settled():
    t = _transport()
    first = t.send("decode-0", "t1", [0, 1], [2, 3], layers=[0])
    second = t.send("decode-0", "t1", [0, 1], [2, 3], layers=[1])
    abort = t.abort("decode-0", "t1", "cancelled")
    assert abort.poll() == PENDING and t.kinds("t1") == []  # a write may still land: no notice yet
    assert t.abort("decode-0", "t1", "again") is abort
    first.succeed()
    assert abort.poll() == PENDING and t.kinds("t1") == []
    second.fail("error", "NIXL reported the transfer failed")
    assert abort.poll() == DONE and t.kinds("t1") == [pb.KVNotice.ABORT]
    # nothing in flight: the notice goes out at once
    assert t.abort("decode-0", "t2", "cancelled").poll() == DONE and t.kinds("t2") == [pb.KVNotice.ABORT]
    assert not t._aborting and not t._posted


def test_a_failed_send_after_final_aborts_only_once_the_others_settled():
    t = _transport()
    a = t.send("decode-0", "t1", [0], [2], layers=[0])
    b = t.send("decode-0", "t1", [0], [2], layers=[1])
    t.finish("decode-0", "t1")
    a.fail("error", "NIXL reported the transfer failed")  # FINAL counted it: the transfer aborts
    assert t.kinds("t1") == [pb.KVNotice.FINAL]
    b.succeed()
    assert t.abort("decode-0", "t1", "dropped").poll() == DONE
    assert t.kinds("t1") == [pb.KVNotice.FINAL, pb.KVNotice.ABORT]


@pytest.fixture
def engine(tiny_model):
    from disagg.worker.engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    return LLMEngine(tiny_model, num_gpu_blocks=12, block_size=BLOCK)


def _core(engine, transport, role: str):
    from disagg.worker.serving.core import WorkerCore
    from disagg.worker.serving.metrics import ServingMetrics

    return WorkerCore(engine, transport, BLOCK, ServingMetrics(role, "tiny"))


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 200, (n,), generator=g).tolist()


def _idle(core) -> None:
    core.refresh_load()
    load = core.load
    assert load["free_blocks"] == load["total_blocks"], load
    assert load["reserved_blocks"] == load["pinned_blocks"] == load["inflight_requests"] == 0, load


def test_prefill_aborted_while_sending_keeps_its_blocks_and_answers_after_the_sends(engine):
    from disagg.worker.serving.prefill_job import PrefillError, PrefillJob

    t = _transport(engine.kv_cache)
    core = _core(engine, t, "prefill")
    answers = []
    job = PrefillJob("r:1:0", "r", "decode-0", list(range(3)), 0, answers.append)
    core.on_loop_prefill(job, _prompt(40, 1), SamplingParams(max_tokens=1), 0.0)
    while job.state == "prefilling":
        core.step()
    assert t.posted and all(h.state == PENDING for h in t.posted)
    core.on_loop_abort("r:1:0")  # D gave up on a slow transfer
    core.sender.poll()
    core.refresh_load()
    # the posted writes still read these blocks and may still land on D: no notice, no answer
    assert core.load["pinned_blocks"] == 3 and core.load["free_blocks"] < core.load["total_blocks"]
    assert t.kinds("r:1:0") == [pb.KVNotice.FINAL] and answers == []
    for h in t.posted:
        h.succeed()
    assert not core.sender.poll()
    assert t.kinds("r:1:0") == [pb.KVNotice.FINAL, pb.KVNotice.ABORT]
    assert answers == [PrefillError("prefill_failed", "aborted by the decode worker")]
    _idle(core)


def test_an_abort_before_its_prefill_arrives_refuses_the_prefill_so_not_found_means_settled(engine):
    from disagg.worker.serving.prefill_job import PrefillError, PrefillJob

    t = _transport(engine.kv_cache)
    core = _core(engine, t, "prefill")
    # D gave up while its Prefill RPC was still on the way: P has nothing of it yet
    assert core.on_loop_abort("r:1:0") is False
    answers = []
    job = PrefillJob("r:1:0", "r", "decode-0", list(range(3)), 0, answers.append)
    core.on_loop_prefill(job, _prompt(40, 2), SamplingParams(max_tokens=1), 0.0)
    assert answers == [PrefillError("prefill_failed", "aborted by the decode worker before it started")]
    assert not engine.has_unfinished() and t.posted == []
    # a dropped prefill whose sends have not settled is still "found": its ABORT notice follows
    job = PrefillJob("s:1:0", "s", "decode-0", list(range(3)), 0, answers.append)
    core.on_loop_prefill(job, _prompt(40, 3), SamplingParams(max_tokens=1), 0.0)
    while job.state == "prefilling":
        core.step()
    assert core.on_loop_abort("s:1:0") is True and core.on_loop_abort("s:1:0") is True
    for h in t.posted:
        h.succeed()
    core.sender.poll()
    assert core.on_loop_abort("s:1:0") is False  # settled and released: nothing more will land
    _idle(core)


def _decode(engine):
    t = _transport(engine.kv_cache)
    return t, _core(engine, t, "decode")


def _land(t: HeldTransport, transfer_id: str) -> None:
    t._on_notice("p", pb.KVNotice(kind=pb.KVNotice.FINAL, request_id=transfer_id, parts=0))


def _finish(core, engine, rid: str, outs: list) -> None:
    assert core.receiver.commit(rid, 7, None)
    while engine.has_unfinished():
        core.step()
    assert outs[-1].finished


def test_failed_attempt_that_has_not_settled_is_quarantined_and_the_retry_gets_fresh_blocks(engine):
    t, core = _decode(engine)
    prompt = _prompt(40, 2)
    params = SamplingParams(max_tokens=3, temperature=0)
    outs, reasons = [], []
    dst = core.receiver.reserve("r", prompt, params, outs.append)
    assert core.receiver.expect("r:1:0", "r", reasons.append, dst.fresh_block_ids)
    # the Prefill call timed out and P did not answer the Abort: it may still write into dst
    assert core.receiver.end_attempt("r:1:0", sender_settled=False)
    retry = core.receiver.rereserve("r", prompt, params)
    assert not set(retry.fresh_block_ids) & set(dst.fresh_block_ids)
    assert core.receiver.expect("r:2:1", "r", reasons.append, retry.fresh_block_ids)
    _land(t, "r:2:1")
    assert core.receiver.poll()  # the quarantine still holds the first attempt's blocks
    assert reasons == [None]
    _finish(core, engine, "r", outs)
    core.refresh_load()
    assert core.load["reserved_blocks"] == len(dst.fresh_block_ids)
    assert core.metrics.kv_quarantined._value.get() >= 1
    # the slow P's abort notice (sent once its writes settled) ends the quarantine
    t._on_notice("p", pb.KVNotice(kind=pb.KVNotice.ABORT, request_id="r:1:0", reason="cancelled"))
    assert not core.receiver.poll()
    _idle(core)


def test_all_attempts_failed_the_local_prefill_reuses_the_id_while_blocks_stay_quarantined(engine):
    t, core = _decode(engine)
    prompt = _prompt(40, 3)
    params = SamplingParams(max_tokens=3, temperature=0)
    outs = []
    dst = core.receiver.reserve("r", prompt, params, outs.append)
    core.receiver.expect("r:1:0", "r", lambda _r: None, dst.fresh_block_ids)
    assert core.receiver.end_attempt("r:1:0", sender_settled=False)
    core.on_loop_abort("r")  # every attempt failed: the request prefills locally, same id
    core.on_loop_add("r", prompt, params, outs.append, 0.0)
    while engine.has_unfinished():
        core.step()
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    held = set(engine.block_manager.pinned("quarantine:r:1:0"))
    assert held == set(dst.fresh_block_ids)
    # a failure that is no abort notice (a stall) does not say the writes stopped
    t._on_notice("p", pb.KVNotice(kind=pb.KVNotice.PART, request_id="r:1:0", bytes=1))
    t.tracker.fail_sender("p", "disconnect: peer removed")
    assert core.receiver.poll() and engine.block_manager.pinned("quarantine:r:1:0")
    core.receiver.quarantined["r:1:0"] = 0.0  # the quarantine deadline passed
    assert not core.receiver.poll()
    _idle(core)


def test_a_settled_attempt_retries_into_the_same_blocks(engine):
    t, core = _decode(engine)
    prompt = _prompt(40, 4)
    outs, reasons = [], []
    dst = core.receiver.reserve("r", prompt, SamplingParams(max_tokens=2), outs.append)
    core.receiver.expect("r:1:0", "r", reasons.append, dst.fresh_block_ids)
    t._on_notice("p", pb.KVNotice(kind=pb.KVNotice.ABORT, request_id="r:1:0", reason="KV send failed"))
    core.receiver.poll()
    assert reasons == ["aborted: KV send failed"]
    assert not core.receiver.end_attempt("r:1:0", sender_settled=False)  # its notice settled it
    core.receiver.expect("r:2:1", "r", reasons.append, dst.fresh_block_ids)
    assert not core.receiver.end_attempt("r:2:1", sender_settled=True)  # P answered: settled
    assert not core.receiver.quarantined
    core.on_loop_abort("r")
    _idle(core)


def test_client_gone_quarantines_the_transfer_not_the_request_id(engine):
    t, core = _decode(engine)
    prompt = _prompt(40, 5)
    params = SamplingParams(max_tokens=2, temperature=0)
    outs, reasons = [], []
    dst = core.receiver.reserve("r", prompt, params, outs.append)
    core.receiver.expect("r:1:0", "r", reasons.append, dst.fresh_block_ids)
    assert core.on_loop_abort("r")
    assert reasons == ["aborted"] and outs == [None]
    assert not core.receiver.end_attempt("r:1:0", sender_settled=False)  # already quarantined
    # the same id may come back (a replayed request) while the blocks are held
    again = core.receiver.reserve("r", prompt, params, outs.append)
    assert not set(again.fresh_block_ids) & set(dst.fresh_block_ids)
    core.on_loop_abort("r")
    _land(t, "r:1:0")  # the late transfer completes: the quarantine ends
    assert not core.receiver.poll()
    _idle(core)


def test_client_gone_then_the_sender_says_nothing_will_land_ends_the_quarantine(engine):
    t, core = _decode(engine)
    outs, reasons = [], []
    dst = core.receiver.reserve("r", _prompt(40, 6), SamplingParams(max_tokens=2), outs.append)
    core.receiver.expect("r:1:0", "r", reasons.append, dst.fresh_block_ids)
    assert core.on_loop_abort("r")  # the client went away first: the blocks are held
    assert engine.block_manager.pinned("quarantine:r:1:0")
    # then P answered the attempt's Abort with "not found": it never started, and refuses it now
    assert not core.receiver.end_attempt("r:1:0", sender_settled=True)
    assert not core.receiver.poll()
    _idle(core)


def test_a_landed_transfer_carrying_its_first_token_is_committed_on_the_loop(engine):
    """The first token rides on P's FINAL notice: the loop starts decoding the moment the KV is
    whole, before the asyncio side hears of it; without a token, or when logprobs were asked
    (no `committed` callback), or after the request went away, it leaves the commit alone."""
    t, core = _decode(engine)
    params = SamplingParams(max_tokens=3, temperature=0)
    events, outs = [], []
    dst = core.receiver.reserve("r", _prompt(40, 7), params, outs.append)
    core.receiver.expect("r:1:0", "r", lambda r: events.append(("landed", r)), dst.fresh_block_ids,
                           lambda at: events.append(("committed", outs[:])))  # fmt: skip
    t._on_notice("p", pb.KVNotice(kind=pb.KVNotice.FINAL, request_id="r:1:0", parts=0, first_token=9))
    core.receiver.poll()
    # committed first, with the first token already handed to the stream; then the wait ends
    assert [e[0] for e in events] == ["committed", "landed"] and events[1][1] is None
    assert [o.new_token_ids for o in events[0][1]] == [[9]]
    assert "r" not in core.receiver.reserved and engine.num_running == 1
    assert not core.receiver.commit("r", 9, None)  # nothing left for the answer's path to commit
    while engine.has_unfinished():
        core.step()
    assert outs[-1].finished and outs[-1].outputs[0].token_ids[0] == 9

    committed = []
    # no token in the FINAL (an older or tensor-parallel sender): the answer's path commits
    dst = core.receiver.reserve("s", _prompt(40, 8), params, outs.append)
    core.receiver.expect("s:1:0", "s", events.append, dst.fresh_block_ids, committed.append)
    _land(t, "s:1:0")
    core.receiver.poll()
    assert committed == [] and events[-1] is None and "s" in core.receiver.reserved
    _finish(core, engine, "s", outs)
    # logprobs asked: no callback, the token in the FINAL is not used
    dst = core.receiver.reserve("u", _prompt(40, 9), params, outs.append)
    core.receiver.expect("u:1:0", "u", events.append, dst.fresh_block_ids)
    t._on_notice("p", pb.KVNotice(kind=pb.KVNotice.FINAL, request_id="u:1:0", parts=0, first_token=9))
    core.receiver.poll()
    assert "u" in core.receiver.reserved and events[-1] is None
    _finish(core, engine, "u", outs)
    # the client went away while the KV moved: the late landing ends the quarantine, commits nothing
    dst = core.receiver.reserve("v", _prompt(40, 10), params, outs.append)
    core.receiver.expect("v:1:0", "v", events.append, dst.fresh_block_ids, committed.append)
    assert core.on_loop_abort("v")
    t._on_notice("p", pb.KVNotice(kind=pb.KVNotice.FINAL, request_id="v:1:0", parts=0, first_token=9))
    assert not core.receiver.poll()
    assert committed == [] and not engine.has_unfinished()
    assert t._first_tokens == {}  # taken or dropped with each transfer
    # the asyncio side may hand back an event (its first message written): the loop waits for it,
    # a bounded time, before it steps again
    from disagg.worker.serving import kv_receiver

    class Never(threading.Event):  # never set; records how long each wait was allowed
        def __init__(self):
            super().__init__()
            self.waits = []

        def wait(self, timeout=None):
            self.waits.append(timeout)
            return False

    never = Never()
    dst = core.receiver.reserve("w", _prompt(40, 14), params, outs.append)
    core.receiver.expect("w:1:0", "w", events.append, dst.fresh_block_ids, lambda _at: never)
    t._on_notice("p", pb.KVNotice(kind=pb.KVNotice.FINAL, request_id="w:1:0", parts=0, first_token=9))
    core.receiver.poll()
    assert never.waits == [kv_receiver.FIRST_TOKEN_HANDOFF_SECONDS]
    assert "w" not in core.receiver.reserved and events[-1] is None
    while engine.has_unfinished():
        core.step()
    _idle(core)


def test_the_prefill_side_puts_the_sampled_token_in_its_final_notice(engine):
    from disagg.worker.serving.prefill_job import PrefillJob

    t = _transport(engine.kv_cache)
    core = _core(engine, t, "prefill")
    answers = []
    job = PrefillJob("r:1:0", "r", "decode-0", list(range(3)), 0, answers.append)
    core.on_loop_prefill(job, _prompt(40, 11), SamplingParams(max_tokens=1, temperature=0), 0.0)
    while job.state == "prefilling":
        core.step()
    final = [n for n in t.notices if n.kind == pb.KVNotice.FINAL]
    assert len(final) == 1 and final[0].HasField("first_token") and final[0].first_token == job.token_id
    for h in t.posted:
        h.succeed()
    core.sender.poll()
    assert answers[0].token_id == final[0].first_token
    # what a receiver does with it: held until taken, once; dropped when the transfer fails
    t._on_notice("p", final[0])
    assert t.take_first_token("r:1:0") == job.token_id and t.take_first_token("r:1:0") is None
    t._on_notice("p", pb.KVNotice(kind=pb.KVNotice.FINAL, request_id="x", parts=1, first_token=3))
    t._on_notice("p", pb.KVNotice(kind=pb.KVNotice.ABORT, request_id="x", reason="gone"))
    assert t.poll_failed() == [("x", "aborted: gone")] and t._first_tokens == {}
    _idle(core)


def test_a_transfer_whose_final_came_is_polled_soon_until_its_parts_land(engine):
    from disagg.worker.serving.engine_loop import SOON
    from disagg.worker.serving.prefill_job import PrefillJob

    t, core = _decode(engine)
    dst = core.receiver.reserve("r", _prompt(40, 12), SamplingParams(max_tokens=2), [].append)
    core.receiver.expect("r:1:0", "r", lambda _r: None, dst.fresh_block_ids)
    assert core.receiver.poll() is True  # awaiting: polled, at the plain rate
    t._on_notice("p", pb.KVNotice(kind=pb.KVNotice.FINAL, request_id="r:1:0", parts=2))
    assert core.receiver.poll() == SOON  # two parts still landing
    assert not t.tracker.finishing(now=time.monotonic() + 1.0)  # a sender gone quiet is not "soon"
    for _ in range(2):
        t._on_notice("p", pb.KVNotice(kind=pb.KVNotice.PART, request_id="r:1:0", bytes=1))
    assert core.receiver.poll() is False and not t.finishing()
    assert core.receiver.commit("r", 7, None)
    while engine.has_unfinished():
        core.step()

    # P: a computed prompt's sends are polled soon for a while, then at the plain rate
    p = _transport(engine.kv_cache)
    prefill = _core(engine, p, "prefill")
    job = PrefillJob("s:1:0", "s", "decode-0", list(range(3)), 0, [].append)
    prefill.on_loop_prefill(job, _prompt(40, 13), SamplingParams(max_tokens=1), 0.0)
    while job.state == "prefilling":
        prefill.step()
    assert prefill.sender.poll() == SOON
    job.prefilled_at -= 1.0
    assert prefill.sender.poll() is True
    for h in p.posted:
        h.succeed()
    assert prefill.sender.poll() is False
    _idle(prefill)


class ChildRanks:
    """The other ranks of a tensor-parallel worker as rank 0's transport drives them: posted
    calls are recorded, each `poll` answers what the test queued for that rank."""

    world_size = 2

    def __init__(self):
        self.posted: list[tuple] = []
        self.replies: dict[int, list[dict]] = {1: []}

    def install_on(self, rank: int, *args) -> None:
        pass

    def host_of(self, rank: int) -> None:
        return None  # every rank on this host

    def ask(self, rank: int, service: str, method: str, *args):
        if method == "handshake_payload":
            return b""
        queued = self.replies[rank]
        return (
            queued.pop(0)
            if queued
            else {"sends": {k: "pending" for k in args[0]}, "completed": [], "failed": []}
        )

    def post(self, service: str, method: str, *args) -> None:
        self.posted.append((method, *args))


def _sharded():
    from disagg.worker.kv_transfer.sharded import ShardedTransport

    local = _transport()
    ranks = ChildRanks()
    return local, ranks, ShardedTransport(local, ranks, "held", "held", "127.0.0.1")


def test_tensor_parallel_receiver_reads_an_abort_only_once_every_rank_settled():
    from disagg.worker.serving.kv_receiver import settles

    local, ranks, t = _sharded()
    t.accept("t", [2, 3])
    t.accept("u", [4])
    ranks.replies[1].append({"sends": {}, "completed": ["u"], "failed": [("t", "aborted: cancelled")]})
    [(tid, reason)] = t.poll_failed()
    assert tid == "t" and not settles(reason)  # rank 0's sender may still be writing
    local._on_notice("p", pb.KVNotice(kind=pb.KVNotice.ABORT, request_id="t", reason="cancelled"))
    assert t.poll_failed() == [("t", "aborted: on every tensor-parallel rank")]
    assert ("forget", "t") in ranks.posted and not t._failing
    # landed on rank 1 (settled there), then failed on rank 0 by a stall: never an abort
    local._on_notice("p", pb.KVNotice(kind=pb.KVNotice.PART, request_id="u", bytes=1))
    local.tracker.fail_sender("p", "disconnect: peer removed")
    [(_, reason)] = t.poll_failed()
    assert not settles(reason) and t._failing == {"u": {0}}
    t.forget("u")
    assert not t._failing


def test_an_abort_from_one_of_several_sending_ranks_settles_only_with_the_others():
    from disagg.worker.serving.kv_receiver import settles

    t = _transport()
    abort = pb.KVNotice(kind=pb.KVNotice.ABORT, request_id="t", reason="x", senders=3)
    t._on_notice("p-r0", abort)
    [(_, reason)] = t.poll_failed()
    assert not settles(reason)  # ranks 1 and 2 may still write
    t._on_notice("p-r1", pb.KVNotice(kind=pb.KVNotice.FINAL, request_id="t", parts=0, senders=3))
    t._on_notice("p-r2", abort)
    assert t.poll_failed() == [("t", "aborted: by every sending rank")] and t.poll_completed() == []


def test_tensor_parallel_sender_abort_settles_once_every_rank_sent_its_notice():
    local, ranks, t = _sharded()
    send = t.send("decode-0", "t", [0], [1], layers=[0])
    t.finish("decode-0", "t")
    abort = t.abort("decode-0", "t", "cancelled")
    assert ("abort", "decode-0", "t", "cancelled") in ranks.posted
    assert abort.poll() == PENDING  # rank 1 answers "pending": its notice is not out yet
    send.succeed()
    assert abort.poll() == PENDING and local.kinds("t") == [pb.KVNotice.FINAL, pb.KVNotice.ABORT]
    ranks.replies[1].append({"sends": {("decode-0", "t"): "done"}, "evicted": []})
    assert abort.poll() == DONE


def test_a_rank_asked_again_after_it_settled_does_not_fail_the_handle():
    local, ranks, t = _sharded()
    send = t.send("decode-0", "t", [0], [1], layers=[0])
    finish = t.finish("decode-0", "t")
    finish.settle_rank(1, "done")
    # asked again for another pending handle's sake, the rank no longer knows the key
    finish.settle_rank(1, ("error", "rank 1 has no sends of transfer 't'"))
    send.succeed()
    assert finish.poll() == DONE


# ---- the decode worker's gRPC service, in-process over the same engine -----------------------------
def _service(engine, core, state=None):
    """The engine loop running `core`, and a decode worker's service over them."""
    from disagg.worker.serving.args import ServingArgs
    from disagg.worker.serving.engine_loop import EngineLoop
    from disagg.worker.serving.servicer import ServingOptions, WorkerService

    loop = EngineLoop()
    loop.step_fn, loop.has_work = core.step, core.has_work
    loop.add_poller(core.receiver.poll)
    loop.start(lambda: None).result(timeout=10)
    opts = ServingOptions("decode-0", "decode", "tiny", "127.0.0.1:1",
                          ServingArgs(disagg_threshold=1, prefill_placement="threshold"))  # fmt: skip
    service = WorkerService(opts, loop, core, state, core.metrics, engine.max_model_len)
    service.ready = True
    return loop, service


def _remote_request(request_id: str, prompt: list[int], *addresses: str):
    """A Generate request that the decode worker prefills on the given prefill workers."""
    from disagg.proto import worker_pb2 as wpb

    targets = [wpb.PrefillTarget(worker_id=f"prefill-{i}", address=a) for i, a in enumerate(addresses)]
    return wpb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                               params=wpb.SamplingParams(max_tokens=2), prefill_targets=targets)  # fmt: skip


def _dead_address() -> str:
    """A loopback port nothing listens on: calls to it fail at once (connection refused)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_stream_cancelled_while_its_remote_prefill_reserves_holds_nothing(engine):
    """The stream ends (client gone, a sibling's prompt refused) while the engine loop is
    reserving the blocks of its remote prefill: no Prefill went out, so nothing can land there
    and nothing may stay held for it (a quarantine would keep the blocks for minutes)."""
    import asyncio
    import threading

    t, core = _decode(engine)
    reserving, go_on = threading.Event(), threading.Event()
    reserve = core.receiver.reserve_expecting

    def slow_reserve(*args):
        reserving.set()
        go_on.wait(10)  # the cancel lands while the loop is in here
        return reserve(*args)

    core.receiver.reserve_expecting = slow_reserve
    loop, service = _service(engine, core)
    request = _remote_request("r", _prompt(40, 7), "127.0.0.1:1")

    async def cancel_mid_reservation():
        first = asyncio.ensure_future(service.Generate(request, None).__anext__())
        await asyncio.get_running_loop().run_in_executor(None, reserving.wait, 10)
        first.cancel()
        go_on.set()
        with pytest.raises(asyncio.CancelledError):
            await first

    try:
        asyncio.run(cancel_mid_reservation())
        loop.call(lambda: None).result(timeout=10)  # behind the stream's abort
    finally:
        go_on.set()
        loop.stop()
    assert reserving.is_set() and not core.receiver.quarantined and not core.receiver.kv_waits
    _idle(core)


def test_a_stream_cancelled_between_attempts_finishes_its_transfer_record(engine, redis_url):
    """The first prefill worker failed and the stream is cancelled while that attempt is being
    cleaned up, before the retry: the transfer record in Redis ends with the request, not with
    its lease (until then it holds the blocks in the index)."""
    import asyncio

    from disagg.worker.kv_state import KVState, WorkerInfo
    from disagg.worker.serving.state_link import StateLink

    from ..redis_check import transfer_records

    t, core = _decode(engine)
    kv = KVState(redis_url, "settle", "decode-0")
    state = StateLink(kv, WorkerInfo(id="decode-0", role="decode", address="127.0.0.1:1"))
    loop, service = _service(engine, core, state)
    cleaning = []

    async def hung_cleanup(job):  # P's Abort never answers
        cleaning.append(job.attempt.transfer_id)
        await asyncio.Event().wait()

    service.remote._cleanup_attempt = hung_cleanup
    request = _remote_request("r", _prompt(40, 8), _dead_address(), _dead_address())

    async def cancel_between_attempts():
        first = asyncio.ensure_future(service.Generate(request, None).__anext__())
        aio = asyncio.get_running_loop()
        for _ in range(200):  # the handshake fails at once; the record's write is on its way
            if cleaning and await aio.run_in_executor(None, transfer_records, redis_url, "settle"):
                break
            await asyncio.sleep(0.05)
        assert cleaning, "the first attempt did not fail"
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first

    try:
        asyncio.run(cancel_between_attempts())
    finally:
        loop.stop()
        kv.close()
    assert len(cleaning) == 1 and transfer_records(redis_url, "settle") == []


def _decisions(reason: str) -> float:
    from prometheus_client import REGISTRY

    labels = {"role": "decode", "model": "tiny", "decision": "local", "reason": reason}
    return REGISTRY.get_sample_value("disagg_disaggregation_decisions_total", labels) or 0.0


def _generate_all(service, request) -> list:
    import asyncio

    async def run():
        return [m async for m in service.Generate(request, None)]

    return asyncio.run(run())


@pytest.mark.parametrize("fallback", ["remote_failed", "no_free_blocks"])
def test_a_prompt_placed_remotely_but_prefilled_here_is_counted_with_why(engine, redis_url, fallback):
    """Placed on a prefill worker, then prefilled on the decode worker after all: every prefill
    worker failed (`remote_failed`), or its blocks could not be reserved now (`no_free_blocks`,
    it queues here). The decision counter names that, not the placement's reason."""
    from disagg.worker.engine.block_manager import NoFreeBlocksError
    from disagg.worker.kv_state import KVState, WorkerInfo
    from disagg.worker.serving.state_link import StateLink

    t, core = _decode(engine)
    kv = KVState(redis_url, "fallback", "decode-0")
    state = StateLink(kv, WorkerInfo(id="decode-0", role="decode", address="127.0.0.1:1"))
    if fallback == "no_free_blocks":

        def full(*args):
            raise NoFreeBlocksError("no free blocks")

        core.receiver.reserve_expecting = full
    loop, service = _service(engine, core, state)
    before = {r: _decisions(r) for r in ("remote_failed", "no_free_blocks", "threshold")}
    try:
        msgs = _generate_all(service, _remote_request("r", _prompt(40, 9), _dead_address(), _dead_address()))
    finally:
        loop.stop()
        kv.close()
    assert msgs[-1].finish_reason == "length" and not msgs[-1].HasField("error")
    assert sum(len(m.token_ids) for m in msgs) == 2 and not msgs[0].served_by.prefill_worker
    after = {r: _decisions(r) for r in before}
    assert {r: after[r] - before[r] for r in before} == {
        "remote_failed": fallback == "remote_failed",
        "no_free_blocks": fallback == "no_free_blocks",
        "threshold": 0,
    }
    _idle(core)
