"""KVState against a real redis-server (the `redis_server` / `redis_url` fixtures)."""

from __future__ import annotations

import threading
import time

import pytest

from disagg.worker.kv_state import (
    KVState,
    RedisUnavailable,
    StaleGeneration,
    TransferExists,
    TransferGone,
    WorkerInfo,
    WorkerLoad,
)


@pytest.fixture
def make_state(redis_url):
    made = []

    def make(worker_id: str, role: str = "decode", register: bool = True, **kw) -> KVState:
        state = KVState(redis_url, "test", worker_id, **kw)
        if register:
            state.register(WorkerInfo(worker_id, role, f"127.0.0.1:{5000 + len(made)}"))
        made.append(state)
        return state

    yield make
    for s in made:
        s.close()


def test_registry_lists_live_workers_and_drops_them_by_ttl(make_state):
    d = make_state("d0", "decode", heartbeat_ttl=0.3)
    p = make_state("p0", "prefill", heartbeat_ttl=30)
    d.heartbeat(WorkerLoad(running=2, waiting=1, free_blocks=90, total_blocks=100))
    assert [w.id for w in p.workers()] == ["d0", "p0"]
    (dec,) = p.workers(role="decode")
    assert (dec.load.running, dec.load.free_blocks, dec.address) == (2, 90, "127.0.0.1:5000")
    assert dec.heartbeat_at > 0
    time.sleep(0.5)
    assert [w.id for w in p.workers()] == ["p0"]
    # Its heartbeat finds the entry gone and registers again.
    assert d.heartbeat(WorkerLoad()).reregistered
    assert [w.id for w in p.workers()] == ["d0", "p0"]
    assert not d.heartbeat(WorkerLoad()).reregistered


def test_transfer_lifecycle_with_generation_fencing(make_state):
    d = make_state("d0")
    gen = d.begin_transfer("r1", "p0", "d0", [4, 5], lease_seconds=30)
    with pytest.raises(TransferExists):
        d.begin_transfer("r1", "p0", "d0", [4, 5], lease_seconds=30)
    rec = d.get_transfer("r1")
    assert (rec.prefill_owner, rec.dst_blocks, rec.generation) == ("p0", [4, 5], gen)
    # D gives the transfer to another prefill worker: the old generation is fenced off.
    gen2 = d.reassign("r1", gen, "p1", lease_seconds=30)
    assert gen2 > gen and d.get_transfer("r1").prefill_owner == "p1"
    with pytest.raises(StaleGeneration):
        d.ensure_generation("r1", gen)
    with pytest.raises(StaleGeneration):
        d.renew("r1", gen, lease_seconds=30)
    d.ensure_generation("r1", gen2)
    d.renew("r1", gen2, lease_seconds=30)
    d.finish("r1", gen2)
    assert d.get_transfer("r1") is None
    with pytest.raises(TransferGone):
        d.finish("r1", gen2)
    # a reassignment frees nothing: the replaced prefill worker drops its job when D aborts it
    p0 = make_state("p0", "prefill", register=False)
    assert p0.drain_reclaims() == []


def test_generations_never_repeat_for_a_reused_request_id(make_state):
    d = make_state("d0")
    g1 = d.begin_transfer("r", "p0", "d0", [2], 30)
    d.finish("r", g1)
    g2 = d.begin_transfer("r", "p0", "d0", [2], 30)
    assert g2 > g1
    with pytest.raises(StaleGeneration):
        d.finish("r", g1)


def test_expired_lease_is_reaped_and_reclaimed_by_its_decode_worker_exactly_once(make_state):
    d = make_state("d0")
    p = make_state("p0", "prefill")
    now = time.time()
    gen = d.begin_transfer("r1", "p0", "d0", [8, 9], lease_seconds=5, now=now)
    d.begin_transfer("r2", "p0", "d0", [4], lease_seconds=60, now=now)
    assert d.reap(now=now + 1).expired_transfers == []
    d.renew("r1", gen, lease_seconds=5, now=now + 4)  # pushed to now + 9
    assert d.reap(now=now + 6).expired_transfers == []
    report = p.reap(now=now + 10)
    assert report.expired_transfers == ["r1"] and report.reclaims_queued == 1
    assert d.get_transfer("r1") is None and d.get_transfer("r2") is not None
    with pytest.raises(TransferGone):
        d.ensure_generation("r1", gen)  # the late owner must not touch the blocks
    # the decode worker reserved the blocks: it reclaims them; the prefill worker holds nothing
    assert [(r.request_id, r.blocks, r.reason) for r in d.drain_reclaims()] == [
        ("r1", [8, 9], "lease_expired")
    ]
    assert p.drain_reclaims() == [] and d.drain_reclaims() == []
    assert p.reap(now=now + 10).expired_transfers == []


def test_concurrent_reapers_settle_each_transfer_once(make_state):
    d = make_state("d0")
    p = make_state("p0", "prefill")
    now = time.time()
    for i in range(200):
        d.begin_transfer(f"r{i}", "p0", "d0", [1000 + i], lease_seconds=1, now=now)
    reapers = [make_state(f"x{i}", register=False) for i in range(4)]
    reports = [None] * len(reapers)

    def run(i):
        reports[i] = reapers[i].reap(now=now + 5)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reapers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    reaped = [r for rep in reports for r in rep.expired_transfers]
    assert sorted(reaped) == sorted(f"r{i}" for i in range(200))  # each by exactly one reaper
    assert p.drain_reclaims() == []
    assert sorted(b for r in d.drain_reclaims() for b in r.blocks) == list(range(1000, 1200))


def test_prefix_index_longest_match_and_dead_worker_cleanup(make_state):
    a = make_state("a", "prefill", heartbeat_ttl=30)
    b = make_state("b", "prefill", heartbeat_ttl=0.3)
    c = make_state("c", "decode", heartbeat_ttl=30)
    prompt = [0x11, 0x22, 0x33, 0x44]
    a.publish_blocks(prompt)
    b.publish_blocks(prompt[:2])
    c.publish_blocks([0x11, 0x33])  # a gap after the first block
    assert a.match_prefix(prompt) == {"a": 4, "b": 2, "c": 1}
    a.unpublish_blocks([0x44])
    assert a.match_prefix(prompt) == {"a": 3, "b": 2, "c": 1}
    assert a.match_prefix([0x99]) == {}
    time.sleep(0.5)  # b stops heartbeating and expires
    assert a.match_prefix(prompt) == {"a": 3, "c": 1}  # dead workers never count
    report = a.reap()
    assert report.dead_workers == ["b"] and report.index_entries_removed == 2
    assert a.link.client.smembers(a.keys.block(0x22)) == {"a"}
    assert not a.link.client.exists(a.keys.worker_blocks("b"))


def test_a_restarted_worker_starts_with_a_clean_slate(make_state, redis_url):
    old = make_state("p0", "prefill")
    old.publish_blocks([1, 2])
    gen = old.begin_transfer("r", "p1", "p0", [2], lease_seconds=1, now=time.time())
    old.reap(now=time.time() + 5)  # queues a reclaim for p0 that the old process never drained
    new = KVState(redis_url, "test", "p0")
    try:
        new.register(WorkerInfo("p0", "prefill", "127.0.0.1:6000"))
        assert new.drain_reclaims() == [] and new.match_prefix([1]) == {}
        with pytest.raises(TransferGone):
            new.ensure_generation("r", gen)
    finally:
        new.close()


def test_redis_restart_fails_cleanly_then_recovers_and_republishes(make_state, redis_server):
    held = [0xA1, 0xA2, 0xA3]
    calls = []
    w = make_state("w0", "prefill", on_reregister=lambda: calls.append(1), timeout=0.5)
    w.publish_blocks(held)
    assert w.available
    redis_server.stop()
    try:
        for call in (lambda: w.heartbeat(WorkerLoad()), lambda: w.match_prefix(held), w.drain_reclaims,
                     lambda: w.begin_transfer("r", "w0", "d0", [2], 30), w.reap):  # fmt: skip
            with pytest.raises(RedisUnavailable):  # an error, never a hang that would stall serving
                call()
        assert not w.available and w.link.outages == 1  # one outage, logged once
        assert not w.ping()
    finally:
        redis_server.start()
    # The restarted server is empty: the next heartbeat notices and registers again.
    assert w.heartbeat(WorkerLoad(free_blocks=3)).reregistered and calls == [1]
    assert w.available
    assert w.match_prefix(held) == {}
    w.republish(held)
    assert w.match_prefix(held) == {"w0": 3}
    assert [x.id for x in w.workers()] == ["w0"]
