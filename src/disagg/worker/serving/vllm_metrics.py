"""The worker's load under the names vLLM publishes, for the field's routers that scrape model
servers by them (the Gateway API Inference Extension's endpoint picker, llm-d's scheduler):

  vllm:num_requests_running   = disagg_num_requests_running
  vllm:num_requests_waiting   = disagg_num_requests_waiting
  vllm:kv_cache_usage_perc    = disagg_kv_cache_usage_ratio (a fraction, 0..1, as vLLM's is)

They are read from the disagg gauges at scrape time, so there is one value and no second place
to set it; vLLM's label `model_name` carries the served model.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

ALIASES = {
    "vllm:num_requests_running": ("running", "Requests being served (disagg_num_requests_running)."),
    "vllm:num_requests_waiting": ("waiting", "Requests queued (disagg_num_requests_waiting)."),
    "vllm:kv_cache_usage_perc": (
        "kv_usage",
        "Fraction of KV blocks in use, 0..1 (disagg_kv_cache_usage_ratio).",
    ),
}


class VLLMAliases(Collector):
    """Re-exports the gauges of one registry's metric families (`metrics._Families`)."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        for name, (attr, doc) in ALIASES.items():
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            for metric in getattr(self.families, attr).collect():
                for sample in metric.samples:
                    family.add_metric([sample.labels["model"]], sample.value)
            if family.samples:  # a router has no engine: it publishes none of them
                yield family

    def describe(self):
        return []  # names are known only at collection; nothing to check at registration
