"""Speculative decoding counters on the metrics page follow the engine's cumulative statistics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from disagg.worker.engine.speculative.stats import SpecStats
from disagg.worker.serving.metrics import ServingMetrics


def value(registry: CollectorRegistry, name: str, **labels) -> float:
    got = registry.get_sample_value(name, {"role": "decode", "model": "m", "proposer": "ngram", **labels})
    return 0.0 if got is None else got


def test_speculation_counters_follow_the_engine_stats():
    registry = CollectorRegistry()
    metrics = ServingMetrics("decode", "m", registry)
    stats = SpecStats("ngram", num_tokens=3)
    stats.num_verify_steps = 2
    stats.record(3, 3)
    stats.record(2, 0)
    metrics.speculation(stats)
    assert value(registry, "disagg_spec_decode_proposed_tokens_total") == 5
    assert value(registry, "disagg_spec_decode_accepted_tokens_total") == 3
    assert value(registry, "disagg_spec_decode_verify_steps_total") == 2
    lengths = [
        value(registry, "disagg_spec_decode_acceptance_length_total", accepted=str(a)) for a in range(4)
    ]
    assert lengths == [1, 0, 0, 1]

    stats.num_verify_steps += 1
    stats.record(3, 1)
    metrics.speculation(stats)
    metrics.speculation(stats)  # nothing new: nothing added
    assert value(registry, "disagg_spec_decode_proposed_tokens_total") == 8
    assert value(registry, "disagg_spec_decode_accepted_tokens_total") == 4
    assert value(registry, "disagg_spec_decode_verify_steps_total") == 3
    lengths = [
        value(registry, "disagg_spec_decode_acceptance_length_total", accepted=str(a)) for a in range(4)
    ]
    assert lengths == [1, 1, 0, 1]
