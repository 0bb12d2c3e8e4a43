"""Routing policy (pure): decode by load and free KV, prefill by cached prefix then queue."""

from __future__ import annotations

from dataclasses import replace

from disagg.worker.router.policy import (
    Lending,
    WorkerView,
    choose_decode,
    rank_holders,
    rank_prefill,
    worth_lending,
)


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


def test_a_colocated_worker_is_offered_the_workers_holding_more_of_its_prompt():
    chosen = w("b1", "both")
    pool = [chosen, w("b2", "both"), w("b3", "both"), w("p1", "prefill"), w("d1", "decode")]
    match = {"b1": 2, "b2": 5, "b3": 2, "p1": 4, "d1": 9}
    # longest first; a decode worker cannot prefill for it, and an equal prefix buys nothing
    assert [h.worker_id for h in rank_holders(pool, chosen, match)] == ["b2", "p1"]
    assert [h.worker_id for h in rank_holders(pool, chosen, match, limit=1)] == ["b2"]
    assert rank_holders(pool, chosen, {"b1": 5, "b2": 5}) == []
    assert rank_holders(pool, chosen, {}) == []


def test_prefill_ranking_prefers_the_shorter_token_queue():
    light = replace(w("p1", role="prefill", running=3), queued_prefill_tokens=100)
    heavy = replace(w("p2", role="prefill"), queued_prefill_tokens=5000)
    assert [p.worker_id for p in rank_prefill([heavy, light], {})] == ["p1", "p2"]


def test_overflow_is_off_unless_asked():
    workers = [w("d1", running=9), w("p1", role="prefill")]
    assert choose_decode(workers).worker_id == "d1"


def test_overflow_lends_a_prefill_worker_past_the_margin():
    p = w("p1", role="prefill", running=1)  # one prefill job counts as a running request
    # 1 + 2 < 3 is false
    assert choose_decode([w("d1", running=3), p], lending=Lending(2.0)).worker_id == "d1"
    assert choose_decode([w("d1", running=4), p], lending=Lending(2.0)).worker_id == "p1"
    # the router's own in-flight count on the decode worker weighs like its heartbeat
    assert choose_decode([w("d1", inflight=4), p], lending=Lending(2.0)).worker_id == "p1"


def test_overflow_never_lends_a_prefill_worker_with_prompts_to_prefill():
    # its lent stream's tokens would wait behind every chunk of those prompts
    waiting = w("p1", role="prefill", waiting=1)
    prefilling = replace(w("p1", role="prefill", running=1), queued_prefill_tokens=700)
    for p in (waiting, prefilling):
        assert choose_decode([w("d1", running=9), p], lending=Lending(0.0)).worker_id == "d1"
        assert choose_decode([p], lending=Lending(0.0)) is None
    assert (
        choose_decode(
            [w("d1", running=9), w("p2", role="prefill", running=1)], lending=Lending(0.0)
        ).worker_id
        == "p2"
    )


def test_overflow_picks_the_lightest_prefill_worker_and_covers_an_empty_decode_pool():
    ps = [w("p1", role="prefill", running=2), w("p2", role="prefill")]
    assert choose_decode([w("d1", running=5), *ps], lending=Lending(1.0)).worker_id == "p2"
    assert choose_decode(ps, lending=Lending(1.0)).worker_id == "p2"
    assert choose_decode(ps) is None  # without overflow a prefill worker never decodes


def test_overflow_lends_a_request_only_when_its_prompt_costs_less_than_the_steps_it_saves():
    # P computes 1000 tokens/s; D's decode steps take 50 ms: a 1000-token prompt (1 s on P, where
    # lent streams wait) pays off from 20 output tokens on
    p = replace(w("p1", role="prefill"), prefill_tokens_per_s=1000.0)
    d = replace(w("d1", running=9), decode_step_seconds=0.05)
    assert worth_lending(p, d, 1000, 20) and not worth_lending(p, d, 1000, 19)
    assert choose_decode([d, p], lending=Lending(1.0, 1000, 64)).worker_id == "p1"  # chat-like
    assert choose_decode([d, p], lending=Lending(1.0, 1000, 16)).worker_id == "d1"  # summary-like
    # a prefix cached on the lender is not recomputed: 3 of 4 blocks cached leave 250 tokens
    assert choose_decode([d, p], {"p1": 3}, 4, Lending(1.0, 1000, 16)).worker_id == "p1"
    # unmeasured on either side, an unknown size, or no decode worker to relieve: the margin decides
    assert worth_lending(replace(p, prefill_tokens_per_s=0.0), d, 1000, 1)
    assert worth_lending(p, replace(d, decode_step_seconds=0.0), 1000, 1)
    assert worth_lending(p, d, 1000, 0) and worth_lending(p, None, 1000, 1)
    assert choose_decode([p], lending=Lending(1.0, 1000, 1)).worker_id == "p1"


def test_overflow_weighs_a_cached_prefix():
    # d1 holds the whole prompt: its cost drops by one request, keeping it under the margin
    workers = [w("d1", running=3), w("p1", role="prefill", running=1)]
    assert choose_decode(workers, {}, 4, lending=Lending(1.0)).worker_id == "p1"
    assert choose_decode(workers, {"d1": 4}, 4, lending=Lending(1.0)).worker_id == "d1"
