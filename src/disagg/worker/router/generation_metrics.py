"""What the router records of each generation as its client saw it, into `ServingMetrics`
(serving/metrics.py defines the series): latencies run from the request's arrival, before its
body was read, to the bytes the client was written."""

from __future__ import annotations

from disagg.worker.router.fanout import ChoiceState
from disagg.worker.serving.metrics import ServingMetrics


def record(
    metrics: ServingMetrics, arrival: float, state: ChoiceState, finish: str, first: float | None, end: float
) -> None:
    """TTFT (from arrival to `first`, its first byte written), each later token's gap, its tokens,
    e2e (to `end`, its last byte written) and how it finished."""
    if first is not None:
        metrics.ttft.observe(first - arrival)
    for gap in state.itl:
        metrics.itl.observe(gap)
    metrics.prompt_tokens.inc(state.prompt_tokens or 0)
    metrics.generation_tokens.inc(state.output_tokens)
    metrics.e2e.observe(end - arrival)
    metrics.request_finished(finish)
