"""Speculation only where it pays: the expected tokens of a proposal, and the proposal length
chosen from step costs (memory-bound: extra rows nearly free; compute-bound: a row costs a step)."""

from __future__ import annotations

import pytest

from disagg.worker.engine.speculative.acceptance import AcceptanceEstimate
from disagg.worker.engine.speculative.cost import StepCosts, choose_k, expected_tokens

MEMORY_BOUND = StepCosts([1, 2, 4, 8, 16], [1.0, 1.02, 1.05, 1.1, 1.3])
COMPUTE_BOUND = StepCosts([1, 2, 4, 8, 16], [1.0, 1.9, 3.8, 7.6, 15.2])


def test_expected_tokens():
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.0, 4) == 1
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_step_costs_interpolate_and_extrapolate():
    assert MEMORY_BOUND(4) == 1.05
    assert MEMORY_BOUND(3) == pytest.approx(1.035)
    assert MEMORY_BOUND(32) == pytest.approx(1.3 + 0.2 / 8 * 16)
    assert MEMORY_BOUND(0) == 1.0


def test_measured_costs_never_decrease_with_rows():
    times = iter([0.0, 5.0, 5.0, 5.0] + [0.0, 1.0, 1.0, 1.0])
    costs = StepCosts.measure(lambda n: next(times), [1, 2], repeats=3)
    assert costs.seconds[1] >= costs.seconds[0]


@pytest.mark.parametrize(
    "alphas, budgets, costs, draft, want",
    [
        ([0.9], [4], MEMORY_BOUND, None, 4),  # likely accepted, rows almost free: all of it
        ([0.9], [2], MEMORY_BOUND, None, 2),  # never beyond the budget
        ([0.9], [4], COMPUTE_BOUND, None, 0),  # every row costs a step: plain decoding
        ([0.05], [4], MEMORY_BOUND, None, 0),  # nearly always rejected: not worth the extra rows
        ([0.9], [4], MEMORY_BOUND, StepCosts([1, 2], [0.9, 0.9]), 0),  # a draft as costly as the target
        ([0.9], [4], MEMORY_BOUND, StepCosts([1, 2], [0.05, 0.06]), 4),  # a cheap draft
        ([0.9, 0.0], [4, 4], MEMORY_BOUND, None, 4),  # a request below the floor does not propose
    ],
)
def test_choose_k(alphas, budgets, costs, draft, want):
    assert choose_k(alphas, budgets, costs, draft) == want


def test_acceptance_estimate_falls_with_rejections_and_recovers_while_idle():
    est = AcceptanceEstimate(min_acceptance=0.3)
    assert est.rate("r") == 1.0
    for _ in range(8):
        est.record("r", 4, 0)
    assert est.rate("r") == 0.0  # below the floor: does not propose
    for _ in range(60):
        est.idle("r")
    assert est.rate("r") > 0.9  # tries again after a while
    est.record("r", 4, 4)
    est.forget("r")
    assert 0.4 < est.rate("r") < 0.6  # a new request starts from every request's recent rate


def test_a_new_request_starts_from_the_recent_rate_and_still_probes():
    est = AcceptanceEstimate(min_acceptance=0.3)
    assert est.rate("fresh") == 1.0  # nothing seen yet: propose
    for i in range(20):  # a proposer that never hits, over many short requests
        est.record(f"r{i}", 4, 0)
    assert est.rate("new") == 0.0  # the next request does not spend its first steps relearning it
    for _ in range(60):
        est.idle("new")
    assert est.rate("new") > 0.9  # and still tries again after a while
    for i in range(40):  # the proposer starts hitting: new requests propose from the start
        est.record(f"s{i}", 4, 4)
    assert est.rate("newer") > 0.9


def _probe_bursts(check, steps: int, spec_seconds: float, spec_tokens: int) -> list[int]:
    """First steps of each run of consecutive speculative steps at batch 1 over `steps` steps."""
    starts, last = [], None
    for step in range(steps):
        if check.allows(1):
            if last != step - 1:
                starts.append(step)
            last = step
            check.speculative_step(1, spec_seconds, spec_tokens)
        else:
            check.plain_step(1, 0.001)
    return starts


def test_a_batch_size_where_speculation_measured_slower_only_probes():
    from disagg.worker.engine.speculative.throughput import PROBE_EVERY, ThroughputCheck

    check = ThroughputCheck()
    assert not check.allows(1)  # plain decoding is measured first
    check.plain_step(1, 0.001)  # 1 ms per token
    assert check.allows(1)
    # speculating costs 2 ms per token against plain decoding's 1: probes only, ever rarer
    bursts = _probe_bursts(check, 2000, 0.004, 2)
    gaps = [b - a for a, b in zip(bursts, bursts[1:], strict=False)]
    assert bursts[1] - bursts[0] >= PROBE_EVERY and gaps == sorted(gaps) and len(bursts) <= 8
    assert gaps[-1] > 4 * gaps[0]


def test_a_probe_that_wins_resumes_speculation_after_a_long_losing_stretch():
    """A transient loss (load elsewhere, an unlucky proposal) must not lock speculation off: a probe
    is a few steps judged on their own time, not blended into the stale losing estimate."""
    from disagg.worker.engine.speculative.throughput import PROBE_STEPS, ThroughputCheck

    check = ThroughputCheck()
    check.plain_step(1, 0.001)
    _probe_bursts(check, 600, 0.004, 2)  # lost for a while: probes grew rare
    # now speculating pays (0.5 ms per token); the next probe turns it back on for good
    bursts = _probe_bursts(check, 2000, 0.001, 2)
    assert len(bursts) == 1
    assert all(check.allows(1) for _ in range(PROBE_STEPS * 3))
    # a probe's single bad step does not decide it: one rejected proposal among good ones
    check = ThroughputCheck()
    check.plain_step(1, 0.001)
    check.speculative_step(1, 0.004, 2)  # lost
    while not check.allows(1):
        check.plain_step(1, 0.001)
    check.speculative_step(1, 0.0011, 1)  # the probe's first step: the proposal rejected
    for _ in range(PROBE_STEPS - 1):
        assert check.allows(1)
        check.speculative_step(1, 0.0011, 4)
    assert check.allows(1) and check.allows(1)
    check.plain_step(4, 0.002)  # another batch size is judged on its own
    check.speculative_step(4, 0.001, 8)
    assert all(check.allows(4) for _ in range(5))
