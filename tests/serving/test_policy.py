"""Routing policy (pure): decode by load and free KV, prefill by cached prefix then queue."""

from __future__ import annotations

from dataclasses import replace

from disagg.worker.router.policy import WorkerView, choose_decode, rank_prefill


def w(wid, role="decode", running=0, waiting=0, free=100, total=100, inflight=0):
    return WorkerView(wid, role, f"{wid}:1", running, waiting, free, total, inflight)


def test_decode_least_loaded_and_roles():
    workers = [w("d1", running=4), w("d2", running=1), w("p1", role="prefill")]
    assert choose_decode(workers).worker_id == "d2"
    assert choose_decode([w("p1", role="prefill")]) is None
    assert choose_decode([w("b1", role="both")]).worker_id == "b1"


def test_decode_waiting_weighs_more_than_running():
    assert choose_decode([w("a", running=3), w("b", running=1, waiting=2)]).worker_id == "a"


def test_decode_prefers_free_kv():
    assert choose_decode([w("a", free=5), w("b", free=95)]).worker_id == "b"


def test_decode_router_inflight_counts_when_heartbeat_is_stale():
    # heartbeat says both idle; this router already sent 3 requests to a
    assert choose_decode([w("a", inflight=3), w("b")]).worker_id == "b"


def test_decode_prefix_breaks_ties():
    assert choose_decode([w("a"), w("b")], {"b": 4}, prompt_blocks=4).worker_id == "b"
    # but a big load gap beats the cache
    assert choose_decode([w("a"), w("b", running=5, waiting=2)], {"b": 4}, 4).worker_id == "a"


def test_deterministic_tie_break():
    assert choose_decode([w("b"), w("a")]).worker_id == "a"


def test_prefill_longest_prefix_then_queue():
    ps = [
        w("p1", "prefill", running=0),
        w("p2", "prefill", running=3),
        w("p3", "prefill", running=1),
        w("d", "decode"),
    ]
    assert [p.worker_id for p in rank_prefill(ps, {"p2": 3, "p3": 1}, limit=3)] == ["p2", "p3", "p1"]
    assert [p.worker_id for p in rank_prefill(ps, {}, limit=2)] == ["p1", "p3"]
    assert rank_prefill([w("d")], {}) == []


def test_prefill_ranking_prefers_the_shorter_token_queue():
    light = replace(w("p1", role="prefill", running=3), queued_prefill_tokens=100)
    heavy = replace(w("p2", role="prefill"), queued_prefill_tokens=5000)
    assert [p.worker_id for p in rank_prefill([heavy, light], {})] == ["p1", "p2"]
