"""Serving metrics (Prometheus). Names are a contract: the autoscaler and dashboards read them.

Every series carries `role` (router, prefill, decode, both) and `model`. The metric families
live in prometheus-client's default registry, so one `/metrics` page also shows what other
modules register there (KV transfer bytes/seconds, Redis up).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from disagg.worker.serving.vllm_metrics import VLLMAliases

LABELS = ("role", "model")

# Latency buckets from 1 ms to 2 min: CPU tiny models answer in ms, big prompts take seconds.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 120.0,
)  # fmt: skip


@dataclass
class _Families:
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue_time: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    requests: Counter
    decisions: Counter
    prefix_hits: Counter
    prefix_queries: Counter
    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    kv_free: Gauge
    kv_used: Gauge
    prefix_routing_disabled: Counter
    rejected: Counter
    routed: Counter
    migrations: Counter
    migration_gap: Histogram
    slow_clients: Counter
    prefill_retries: Counter
    kv_quarantined: Counter
    remote_prefill_stages: Histogram
    remote_prefill_commits: Counter
    step_seconds: Histogram
    step_rows: Counter
    weight_bytes: Gauge
    kv_bytes: Gauge
    spec_verify_steps: Counter
    spec_proposed: Counter
    spec_accepted: Counter
    spec_accepted_lengths: Counter
    kv_tier_blocks: Gauge
    kv_tier_hits: Counter
    kv_tier_bytes: Counter
    kv_tier_evictions: Counter
    kv_tier_corrupt: Counter
    kv_tier_read_seconds: Histogram


_FAMILIES: dict[int, _Families] = {}


def _families(registry: CollectorRegistry) -> _Families:
    """One set of metric families per registry (registering a name twice is an error)."""
    key = id(registry)
    if key not in _FAMILIES:

        def hist(name, doc):
            return Histogram(name, doc, LABELS, buckets=_LATENCY_BUCKETS, registry=registry)

        _FAMILIES[key] = _Families(
            ttft=hist("disagg_time_to_first_token_seconds", "Time from arrival to the first token."),
            itl=hist("disagg_inter_token_latency_seconds", "Time between consecutive output tokens."),
            e2e=hist("disagg_e2e_request_latency_seconds", "Time from arrival to the last token."),
            queue_time=hist("disagg_queue_time_seconds", "Time a request waited before it was scheduled."),
            prompt_tokens=Counter(
                "disagg_prompt_tokens", "Prompt tokens processed.", LABELS, registry=registry
            ),
            generation_tokens=Counter(
                "disagg_generation_tokens", "Output tokens generated.", LABELS, registry=registry
            ),
            requests=Counter(
                "disagg_requests", "Finished requests.", (*LABELS, "finish_reason"), registry=registry
            ),
            decisions=Counter(
                "disagg_disaggregation_decisions",
                "Where prompts were prefilled: remote (a prefill worker) or local (the decode worker), "
                "and why (serving/disagg_policy.py).",
                (*LABELS, "decision", "reason"),
                registry=registry,
            ),
            prefix_hits=Counter(
                "disagg_prefix_cache_hits",
                "Prompt blocks found in a prefix cache.",
                LABELS,
                registry=registry,
            ),
            prefix_queries=Counter(
                "disagg_prefix_cache_queries", "Prompt blocks looked up.", LABELS, registry=registry
            ),
            running=Gauge("disagg_num_requests_running", "Requests being served.", LABELS, registry=registry),
            waiting=Gauge("disagg_num_requests_waiting", "Requests queued.", LABELS, registry=registry),
            kv_usage=Gauge(
                "disagg_kv_cache_usage_ratio", "Fraction of KV blocks in use.", LABELS, registry=registry
            ),
            kv_free=Gauge("disagg_kv_blocks_free", "Free KV blocks.", LABELS, registry=registry),
            kv_used=Gauge("disagg_kv_blocks_used", "KV blocks in use.", LABELS, registry=registry),
            prefix_routing_disabled=Counter(
                "disagg_prefix_routing_unavailable",
                "Requests routed without the prefix index because Redis was unreachable.",
                LABELS,
                registry=registry,
            ),
            rejected=Counter(
                "disagg_requests_rejected",
                "Requests refused before serving, by HTTP status.",
                (*LABELS, "status"),
                registry=registry,
            ),
            routed=Counter(
                "disagg_router_routed_generations",
                "Generations the router sent to a worker, by that worker's role (prefill: a prefill "
                "worker serving a whole request under --prefill-overflow).",
                (*LABELS, "worker_role"),
                registry=registry,
            ),
            migrations=Counter(
                "disagg_router_migrations",
                "Live streams moved to another decode worker, by why (unavailable: the worker died or "
                "its connection broke; unresponsive: it stopped answering polls; draining: it handed its "
                "streams off), and by outcome (resumed, or failed: no candidate could take it).",
                (*LABELS, "reason", "outcome"),
                registry=registry,
            ),
            migration_gap=Histogram(
                "disagg_router_migration_gap_seconds",
                "The pause a moved stream's client saw: from the last token the old worker sent to the "
                "first one the new worker sent.",
                LABELS,
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
            slow_clients=Counter(
                "disagg_router_slow_clients",
                "Clients disconnected for not reading their answer within --client-write-timeout "
                "(their generations still running were aborted on the workers).",
                LABELS,
                registry=registry,
            ),
            prefill_retries=Counter(
                "disagg_prefill_retries",
                "Remote prefills retried on another prefill worker after the first one failed.",
                LABELS,
                registry=registry,
            ),
            kv_quarantined=Counter(
                "disagg_kv_quarantined_transfers",
                "KV transfers given up on before they settled (a slow prefill worker, a client gone): "
                "their blocks were held apart until the sender's abort notice or the quarantine deadline.",
                LABELS,
                registry=registry,
            ),
            remote_prefill_commits=Counter(
                "disagg_remote_prefill_commits",
                "Remote prefills committed on the decode worker, by what carried the first token: "
                "landing (the KV transfer's FINAL notice, committed as the last part landed) or answer "
                "(the Prefill RPC's answer: logprobs were asked, or the sender sent no token).",
                (*LABELS, "on"),
                registry=registry,
            ),
            remote_prefill_stages=Histogram(
                "disagg_remote_prefill_stage_seconds",
                "Where a remote prefill's time went, seen from the decode worker: setup (block "
                "reservation, Redis transfer record), queue and compute on the prefill worker, the KV "
                "still moving after the compute, overhead (the Prefill RPC's hops beyond those), "
                "commit (the landed prompt joining the decode batch).",
                (*LABELS, "stage"),
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
            step_seconds=Histogram(
                "disagg_engine_step_seconds",
                "Engine steps by kind: decode (every row one next token) or prefill (a prompt chunk, "
                "decode rows possibly beside it). Their sum over the wall time is how busy the engine "
                "is; the rest of a busy worker's time goes to serving each token (streams, RPCs).",
                (*LABELS, "kind"),
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
            step_rows=Counter(
                "disagg_engine_step_rows",
                "Requests the engine's steps computed, by step kind: over the steps' count, the mean "
                "batch (decode: the decode batch the step time above belongs to).",
                (*LABELS, "kind"),
                registry=registry,
            ),
            weight_bytes=Gauge(
                "disagg_weight_bytes_per_token",
                "Weight bytes a decode step reads per token at batch 1 (layers, final norm, LM head; "
                "8-bit weights with their scales), labelled with the weights' quantization and dtype.",
                (*LABELS, "quantization", "dtype"),
                registry=registry,
            ),
            kv_bytes=Gauge(
                "disagg_kv_bytes_per_token",
                "KV-cache bytes one token takes over all layers (what a transfer moves per prompt token), "
                "labelled with the cache's dtype.",
                (*LABELS, "dtype"),
                registry=registry,
            ),
            spec_verify_steps=Counter(
                "disagg_spec_decode_verify_steps",
                "Target forward passes that verified speculative proposals.",
                (*LABELS, "proposer"),
                registry=registry,
            ),
            spec_proposed=Counter(
                "disagg_spec_decode_proposed_tokens",
                "Tokens proposed by speculative decoding.",
                (*LABELS, "proposer"),
                registry=registry,
            ),
            spec_accepted=Counter(
                "disagg_spec_decode_accepted_tokens",
                "Proposed tokens the target accepted.",
                (*LABELS, "proposer"),
                registry=registry,
            ),
            spec_accepted_lengths=Counter(
                "disagg_spec_decode_acceptance_length",
                "Proposals by how many of their leading tokens were accepted (the accepted label).",
                (*LABELS, "proposer", "accepted"),
                registry=registry,
            ),
            kv_tier_blocks=Gauge(
                "disagg_kv_tier_blocks",
                "KV blocks each tier below the cache holds.",
                (*LABELS, "tier"),
                registry=registry,
            ),
            kv_tier_hits=Counter(
                "disagg_kv_tier_hits",
                "KV blocks restored from a tier instead of recomputed.",
                (*LABELS, "tier"),
                registry=registry,
            ),
            kv_tier_bytes=Counter(
                "disagg_kv_tier_bytes",
                "Bytes moved into (written) and out of (read) each tier.",
                (*LABELS, "tier", "direction"),
                registry=registry,
            ),
            kv_tier_evictions=Counter(
                "disagg_kv_tier_evictions",
                "KV blocks a tier let go of to make room.",
                (*LABELS, "tier"),
                registry=registry,
            ),
            kv_tier_corrupt=Counter(
                "disagg_kv_tier_corrupt_blocks",
                "Disk-tier blocks refused (checksum, truncation, other tokens) and recomputed.",
                (*LABELS, "tier"),
                registry=registry,
            ),
            kv_tier_read_seconds=Histogram(
                "disagg_kv_tier_read_seconds",
                "Time to read one KV block back from a tier's storage.",
                (*LABELS, "tier"),
                buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
                registry=registry,
            ),
        )
        registry.register(VLLMAliases(_FAMILIES[key]))  # vllm:* names for GIE / llm-d
    return _FAMILIES[key]


class ServingMetrics:
    """The metric families bound to one process's role and model.

    A router has no engine: it publishes no queue, running, KV or prefill-retry series (they
    would read 0 forever); its latencies and token counts are what its clients saw.
    """

    def __init__(self, role: str, model: str, registry: CollectorRegistry | None = None):
        self.registry = registry or REGISTRY
        self.role = role
        self.model = model
        f = _families(self.registry)
        lab = {"role": role, "model": model}
        self.ttft = f.ttft.labels(**lab)
        self.itl = f.itl.labels(**lab)
        self.e2e = f.e2e.labels(**lab)
        self.prompt_tokens = f.prompt_tokens.labels(**lab)
        self.generation_tokens = f.generation_tokens.labels(**lab)
        self.prefix_hits = f.prefix_hits.labels(**lab)
        self.prefix_queries = f.prefix_queries.labels(**lab)
        self.prefix_routing_unavailable = f.prefix_routing_disabled.labels(**lab)
        if role != "router":
            self.queue_time = f.queue_time.labels(**lab)
            self.running = f.running.labels(**lab)
            self.waiting = f.waiting.labels(**lab)
            self.kv_usage = f.kv_usage.labels(**lab)
            self.kv_free = f.kv_free.labels(**lab)
            self.kv_used = f.kv_used.labels(**lab)
            self.prefill_retries = f.prefill_retries.labels(**lab)
            self.kv_quarantined = f.kv_quarantined.labels(**lab)
            self._steps = {kind: f.step_seconds.labels(**lab, kind=kind) for kind in ("decode", "prefill")}
            self._step_rows = {kind: f.step_rows.labels(**lab, kind=kind) for kind in ("decode", "prefill")}
            self._commits = {
                on: f.remote_prefill_commits.labels(**lab, on=on) for on in ("landing", "answer")
            }
            self._stages = {
                stage: f.remote_prefill_stages.labels(**lab, stage=stage)
                for stage in ("setup", "queue", "compute", "transfer", "overhead", "commit")
            }
        self._requests = f.requests
        self._weight_bytes = f.weight_bytes
        self._kv_bytes = f.kv_bytes
        self._f = f
        self._spec_seen: dict[str, int | list[int]] = {}
        self._tiers_seen: dict[tuple[str, str], int] = {}
        self._decisions = f.decisions
        self._rejected = f.rejected
        self._routed = f.routed

    def request_finished(self, finish_reason: str) -> None:
        self._requests.labels(
            role=self.role, model=self.model, finish_reason=finish_reason or "unknown"
        ).inc()

    def disaggregation_decision(self, remote: bool, reason: str) -> None:
        self._decisions.labels(
            role=self.role, model=self.model, decision="remote" if remote else "local", reason=reason
        ).inc()

    def remote_prefill_committed(self, on: str) -> None:
        self._commits[on].inc()

    def remote_prefill_stages(self, **seconds: float) -> None:
        for stage, value in seconds.items():
            self._stages[stage].observe(value)

    def engine_step(self, prefill: bool, seconds: float, rows: int) -> None:
        kind = "prefill" if prefill else "decode"
        self._steps[kind].observe(seconds)
        self._step_rows[kind].inc(rows)

    def migrated(self, reason: str, outcome: str, gap_seconds: float | None = None) -> None:
        self._f.migrations.labels(role=self.role, model=self.model, reason=reason, outcome=outcome).inc()
        if gap_seconds is not None:
            self._f.migration_gap.labels(role=self.role, model=self.model).observe(gap_seconds)

    def slow_client(self) -> None:
        self._f.slow_clients.labels(role=self.role, model=self.model).inc()

    def routed(self, worker_role: str) -> None:
        self._routed.labels(role=self.role, model=self.model, worker_role=worker_role).inc()

    def rejected(self, status: int) -> None:
        self._rejected.labels(role=self.role, model=self.model, status=str(status)).inc()

    def prefix_lookup(self, queried_blocks: int, hit_blocks: int) -> None:
        self.prefix_queries.inc(queried_blocks)
        self.prefix_hits.inc(hit_blocks)

    def kv_blocks(self, free: int, total: int) -> None:
        used = max(total - free, 0)
        self.kv_free.set(free)
        self.kv_used.set(used)
        self.kv_usage.set(used / total if total else 0.0)

    def weights(self, quantization: str, dtype: str, bytes_per_token: int) -> None:
        """The served weights: set once, when the engine has loaded."""
        self._weight_bytes.labels(
            role=self.role, model=self.model, quantization=quantization, dtype=dtype
        ).set(bytes_per_token)

    def kv_cache(self, dtype: str, bytes_per_token: int) -> None:
        self._kv_bytes.labels(role=self.role, model=self.model, dtype=dtype).set(bytes_per_token)

    def speculation(self, stats) -> None:
        """Bring the speculative decoding counters up to an engine's cumulative `SpecStats`."""
        f, seen = self._f, self._spec_seen
        lab = {"role": self.role, "model": self.model, "proposer": stats.proposer}
        for family, name in ((f.spec_verify_steps, "num_verify_steps"), (f.spec_proposed, "num_proposed"),
                             (f.spec_accepted, "num_accepted")):  # fmt: skip
            value = getattr(stats, name)
            family.labels(**lab).inc(value - seen.get(name, 0))
            seen[name] = value
        before = seen.get("accepted_lengths") or [0] * len(stats.accepted_lengths)
        for a, (now, was) in enumerate(zip(stats.accepted_lengths, before, strict=True)):
            child = f.spec_accepted_lengths.labels(**lab, accepted=str(a))
            if now > was or not seen:
                child.inc(now - was)
        seen["accepted_lengths"] = list(stats.accepted_lengths)

    def kv_tiers(self, tiers) -> None:
        """Bring the tier series up to a `KVTiers`'s cumulative counts (and take its read times)."""
        f, seen = self._f, self._tiers_seen
        for tier, now in tiers.snapshot().items():
            lab = {"role": self.role, "model": self.model, "tier": tier}
            f.kv_tier_blocks.labels(**lab).set(now["blocks"])
            for family, name, extra in (
                (f.kv_tier_hits, "hits", {}), (f.kv_tier_evictions, "evictions", {}),
                (f.kv_tier_corrupt, "corrupt", {}), (f.kv_tier_bytes, "bytes_read", {"direction": "read"}),
                (f.kv_tier_bytes, "bytes_written", {"direction": "written"}),
            ):  # fmt: skip
                key = (tier, name)
                family.labels(**lab, **extra).inc(max(now[name] - seen.get(key, 0), 0))
                seen[key] = now[name]
            for seconds in tiers.counters[tier].take_read_seconds():
                f.kv_tier_read_seconds.labels(**lab).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
