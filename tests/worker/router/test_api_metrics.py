"""The router's /metrics count what the router saw: requests, prompt and generated tokens, TTFT
and one ITL sample per token after the first; no engine series (running, waiting, KV) it cannot know."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def released(api_cluster, redis_server):
    yield
    api_cluster.assert_released(redis_server.url)


def test_router_metrics_are_what_the_router_saw(api_cluster, client):
    def m(name: str) -> float:
        return api_cluster.metric("router", name)

    names = ["disagg_prompt_tokens_total", "disagg_generation_tokens_total", "disagg_requests_total",
             "disagg_time_to_first_token_seconds_count", "disagg_inter_token_latency_seconds_count"]  # fmt: skip
    before = {n: m(n) for n in names}
    prompt = list(range(20, 45))
    client.completions.create(model=api_cluster.model_name, prompt=prompt, max_tokens=7, n=2,
                              extra_body={"ignore_eos": True})  # fmt: skip
    stream = client.completions.create(model=api_cluster.model_name, prompt=prompt[:9], max_tokens=5, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    for _chunk in stream:  # read to the end
        pass
    delta = {n: m(n) - before[n] for n in names}
    assert delta["disagg_requests_total"] == 3
    assert delta["disagg_prompt_tokens_total"] == 2 * 25 + 9
    assert delta["disagg_generation_tokens_total"] == 2 * 7 + 5
    assert delta["disagg_time_to_first_token_seconds_count"] == 3
    assert delta["disagg_inter_token_latency_seconds_count"] == 2 * 6 + 4  # one per token after the first
    import urllib.request

    with urllib.request.urlopen(f"{api_cluster.url}/metrics", timeout=5) as r:
        page = r.read().decode()
    for absent in ("disagg_num_requests_running{", "disagg_num_requests_waiting{", "disagg_kv_cache_usage_ratio{",
                   "disagg_kv_blocks_free{", "disagg_kv_blocks_used{", "disagg_queue_time_seconds_count{"):  # fmt: skip
        assert absent not in page, absent
