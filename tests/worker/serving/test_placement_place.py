"""`disagg_policy.place`: the decision the engine loop takes for a decode worker, from what the
asyncio side knows (a `Placement`) and what the loop measures (cached tokens, its own site)."""

from disagg.worker.serving.disagg_policy import Placement, PrefillSite, choose_prefill_site, place

RATE = 4000.0


def test_threshold_mode_counts_uncached_tokens_whatever_the_load():
    p = Placement(200, PrefillSite(10**6, 1.0), lambda _tokens: 99.0, mode="threshold", threshold=64)
    busy = PrefillSite(10**6, 1.0)
    assert place(p, cached_tokens=0, local=busy, decoding=8) == place(p, 0, PrefillSite(0, RATE), 0)
    assert place(p, 0, busy, 8).remote and place(p, 0, busy, 8).reason == "threshold"
    short = place(p, cached_tokens=144, local=busy, decoding=8)  # 56 uncached tokens left
    assert not short.remote and short.reason == "short"


def test_load_mode_prices_the_uncached_tokens_with_the_trip_for_them():
    asked = []

    def extra(tokens: int) -> float:
        asked.append(tokens)
        return 0.01

    remote = PrefillSite(500, 2 * RATE)
    p = Placement(1000, remote, extra, mode="load", threshold=64, busy_slack=2.0)
    local = PrefillSite(0, RATE)
    got = place(p, cached_tokens=200, local=local, decoding=3)
    assert asked == [800]  # the transfer: what D lacks
    # the compute: P holds nothing of the prompt, so it computes all 1000 tokens (D's 200 cached
    # ones included, whose K/V it cannot get)
    assert got == choose_prefill_site(800, 64, local, remote, 0.01, 3, 2.0, remote_uncached_tokens=1000)
    held = Placement(1000, PrefillSite(500, 2 * RATE, cached_tokens=600), extra, threshold=64, busy_slack=2.0)
    assert place(held, 200, local, 3) == choose_prefill_site(800, 64, local, held.remote, 0.01, 3, 2.0, 400)
