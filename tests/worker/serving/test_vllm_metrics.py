"""The worker's load under vLLM's metric names (what GIE's endpoint picker and llm-d scrape)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from disagg.worker.serving.metrics import ServingMetrics


def _samples(text: str) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("model_name", "")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("vllm:")
    }


def test_the_worker_load_is_published_under_vllm_names():
    m = ServingMetrics("decode", "tiny", registry=CollectorRegistry())
    m.running.set(3)
    m.waiting.set(2)
    m.kv_blocks(free=25, total=100)
    got = _samples(m.exposition().decode())
    assert got == {
        ("vllm:num_requests_running", "tiny"): 3.0,
        ("vllm:num_requests_waiting", "tiny"): 2.0,
        ("vllm:kv_cache_usage_perc", "tiny"): 0.75,
    }
    m.running.set(5)  # read at scrape time: one value, never a second copy to keep in step
    assert _samples(m.exposition().decode())[("vllm:num_requests_running", "tiny")] == 5.0


def test_a_router_publishes_none_of_them():
    m = ServingMetrics("router", "tiny", registry=CollectorRegistry())
    assert _samples(m.exposition().decode()) == {}
