"""Where a decode worker prefills (serving/disagg_policy.py) and the estimates it prices with."""

import pytest

from disagg.worker.serving.disagg_policy import Placement, PrefillSite, choose_prefill_site, place
from disagg.worker.serving.prefill_estimate import DecodeStepTime, PrefillRate, RemoteCost

RATE = 4000.0  # prompt tokens per second on both sides unless a test says otherwise


def decide(uncached=1000, threshold=64, local=PrefillSite(0, RATE), remote=PrefillSite(0, RATE),
           extra=0.01, decoding=0, slack=2.0):  # fmt: skip
    return choose_prefill_site(uncached, threshold, local, remote, extra, decoding, slack)


def test_short_prompts_and_no_prefill_worker_stay_local():
    assert decide(uncached=63) == decide(uncached=0)
    assert not decide(uncached=63).remote and decide(uncached=63).reason == "short"
    assert decide(remote=None).reason == "no_prefill_worker" and not decide(remote=None).remote


def test_an_idle_decode_worker_never_pays_the_trip_on_equal_hardware():
    # the same rate on both sides: the remote site is the local one plus the transfer, so an idle
    # D prefills itself, and its TTFT is what a colocated worker's would be
    d = decide()
    assert not d.remote and d.reason == "idle_local_faster"
    assert d.remote_s == pytest.approx(d.local_s + 0.01)
    # rates measured apart are a few percent off: a remote estimate a little under the local one
    # is noise, and going remote on it would lose TTFT to a colocated worker
    slightly = decide(remote=PrefillSite(0, RATE * 1.08), extra=0.0)
    assert slightly.remote_s < slightly.local_s and not slightly.remote
    assert decide(remote=PrefillSite(0, RATE * 1.15), extra=0.0).remote


def test_an_idle_decode_worker_uses_a_faster_or_less_loaded_prefill_site():
    assert decide(remote=PrefillSite(0, 4 * RATE)).remote  # a faster prefill pool
    # D's own queue of prompts is longer than the prefill worker's
    d = decide(local=PrefillSite(8000, RATE), remote=PrefillSite(1000, RATE))
    assert d.remote and d.reason == "remote_faster"
    assert d.local_s == pytest.approx(9000 / RATE) and d.remote_s == pytest.approx(2000 / RATE + 0.01)


def test_a_decoding_worker_protects_its_streams_unless_the_prefill_pool_is_backlogged():
    d = decide(decoding=4)
    assert d.remote and d.reason == "protect_decode"
    # the prefill worker is so far behind that the first token would take > 2x the local time
    backlog = decide(decoding=4, remote=PrefillSite(3000, RATE))
    assert not backlog.remote and backlog.reason == "prefill_pool_backlogged"
    # a larger slack tolerates it
    assert decide(decoding=4, remote=PrefillSite(3000, RATE), slack=5.0).remote


def test_an_idle_decode_worker_remeasures_itself_before_trusting_a_stale_rate():
    # its rate says remote is 25% faster, but only the warm-up (or an old step) measured it: a D
    # sending everything away would never correct it, so it prefills this prompt itself
    slow_seed = PrefillSite(0, RATE * 0.8, fresh=False)
    d = decide(local=slow_seed, extra=0.0)
    assert not d.remote and d.reason == "idle_remeasure" and d.remote_s < 0.9 * d.local_s
    assert decide(local=PrefillSite(0, RATE * 0.8), extra=0.0).reason == "remote_faster"  # fresh: trusted
    # staleness changes nothing where the local site wins anyway, or while D is decoding
    assert decide(local=PrefillSite(0, RATE, fresh=False)).reason == "idle_local_faster"
    assert decide(local=slow_seed, decoding=2).reason == "protect_decode"


def _placed(prompt: int, local_cached: int, remote_cached: int, decoding: int = 0):
    # the transfer costs 10 us per token D lacks, plus a 5 ms hop
    p = Placement(prompt, PrefillSite(0, RATE, cached_tokens=remote_cached), lambda n: 0.005 + 1e-5 * n,
                  threshold=64, busy_slack=1.0)  # fmt: skip
    return place(p, local_cached, PrefillSite(0, RATE), decoding)


def test_a_prefix_held_by_the_prefill_worker_is_pulled_not_recomputed():
    """P holds 3600 of a 4000-token prompt (a conversation's history it prefilled): it computes
    400 tokens and sends 4000, cheaper than D's 4000; with D holding the prefix instead, P would
    have to compute it all (D's K/V cannot reach P): D prefills the rest itself."""
    pulled = _placed(4000, local_cached=0, remote_cached=3600)
    assert pulled.remote and pulled.reason == "remote_faster"
    assert pulled.remote_s == pytest.approx(400 / RATE + 0.005 + 0.04)
    assert pulled.local_s == pytest.approx(4000 / RATE)
    kept = _placed(4000, local_cached=3600, remote_cached=0)
    assert not kept.remote and kept.remote_s == pytest.approx(4000 / RATE + 0.005 + 0.004)
    # both hold it: the trip buys nothing
    assert not _placed(4000, local_cached=3600, remote_cached=3600).remote


def test_the_pull_pays_off_only_past_the_transfers_break_even():
    """Transfer at 10 us/token against compute at 250 us/token: pulling a held prefix wins from a
    few dozen tokens on; the 5 ms hop and the 10% idle margin decide the short ones."""
    remote = {held: _placed(held + 64, 0, held).remote for held in (16, 64, 256, 1024)}
    assert remote == {16: False, 64: True, 256: True, 1024: True}


def test_prefill_rate_freshness():
    r = PrefillRate(min_tokens=16, stale_after_s=60.0)
    assert not r.fresh(now=0.0)
    r.observe(1000, 0.5, provisional=True, now=0.0)  # the warm-up: a seed, never fresh
    assert r.tokens_per_s == pytest.approx(2000) and not r.fresh(now=1.0)
    r.observe(1000, 0.25, now=10.0)  # the first served step replaces the seed outright
    assert r.tokens_per_s == pytest.approx(4000) and r.fresh(now=70.0) and not r.fresh(now=70.1)
    r.observe(1000, 0.5, now=20.0)  # a fresh rate averages
    assert r.tokens_per_s == pytest.approx(0.8 * 4000 + 0.2 * 2000)
    r.observe(1000, 0.5, now=200.0)  # after a long silence, the new load replaces the old
    assert r.tokens_per_s == pytest.approx(2000) and r.fresh(now=200.0)


def test_decode_step_time_follows_the_batch():
    d = DecodeStepTime()
    assert d.seconds is None
    d.observe(0.0)  # not a measurement
    assert d.seconds is None
    d.observe(0.05)
    assert d.seconds == pytest.approx(0.05)
    for _ in range(30):  # the batch grew: steps of 80 ms
        d.observe(0.08)
    assert d.seconds == pytest.approx(0.08, rel=0.01)


def test_unmeasured_rates():
    # one side measured: it stands in for the other (same hardware)
    assert not decide(local=PrefillSite(0, None)).remote
    assert not decide(remote=PrefillSite(0, None)).remote
    # neither measured yet: long prompts go remote, which measures the prefill pool
    d = decide(local=PrefillSite(0, None), remote=PrefillSite(0, None))
    assert d.remote and d.reason == "unmeasured"


def test_prefill_rate_ignores_tiny_steps_and_follows_the_load():
    r = PrefillRate(min_tokens=16)
    assert r.tokens_per_s is None
    r.observe(4, 0.001)  # a handful of tokens measures step overhead, not throughput
    assert r.tokens_per_s is None
    r.observe(1000, 0.25)
    assert r.tokens_per_s == pytest.approx(4000)
    for _ in range(30):  # the machine got twice as slow
        r.observe(1000, 0.5)
    assert r.tokens_per_s == pytest.approx(2000, rel=0.01)
    r.observe(1000, 0.0)  # a zero duration is not a measurement
    assert r.tokens_per_s == pytest.approx(2000, rel=0.01)


def test_remote_cost_splits_fixed_overhead_from_per_token_transfer():
    c = RemoteCost(default_overhead_s=0.02)
    assert c.seconds(1000) == pytest.approx(0.02)  # nothing observed: the default, no transfer part
    # D waited 0.40 s: P queued 0.05, computed 0.25, moved KV for 0.06 after the compute
    c.observe(wall_s=0.40, queue_s=0.05, compute_s=0.25, transfer_s=0.06, tokens=600)
    assert c.overhead_s == pytest.approx(0.04)
    assert c.seconds(1000) == pytest.approx(0.04 + 1000 * 0.0001)
    # P's clock and D's can disagree by a little: the overhead never goes negative
    c = RemoteCost()
    c.observe(wall_s=0.30, queue_s=0.05, compute_s=0.25, transfer_s=0.01, tokens=100)
    assert c.overhead_s == 0.0
