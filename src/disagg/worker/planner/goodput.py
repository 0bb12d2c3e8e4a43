"""Goodput as DistServe defines it: the highest request rate at which at least 90% of requests
meet both the TTFT SLO and the TPOT SLO (mean time per output token after the first)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from disagg.worker.planner.profile import Profile
from disagg.worker.planner.simulate import Outcome, decode_context
from disagg.worker.planner.workload import Workload

TARGET = 0.9
SLO_SCALES = (2.0, 4.0, 8.0)  # DistServe's "SLO scale": multiples of the unloaded latency
BASE_SCALE = 4.0


@dataclass(frozen=True)
class SLO:
    ttft: float  # seconds
    tpot: float  # seconds

    def scaled(self, factor: float) -> SLO:
        return SLO(self.ttft * factor, self.tpot * factor)

    def __str__(self) -> str:
        return f"TTFT <= {1e3 * self.ttft:.0f} ms, TPOT <= {1e3 * self.tpot:.1f} ms"


def unloaded_slo(prof: Profile, workload: Workload) -> SLO:
    """The latency one request alone sees on one colocated replica: its workload's longest prompt
    prefilled, then decode steps of batch 1 over its context. SLO scale 1."""
    longest, most = workload.longest_prompt, workload.output_tokens[1]
    return SLO(float(prof.prefill_seconds(longest)), prof.decode_seconds(1, decode_context(longest, most)))


def attainment(out: Outcome, slo: SLO, trim: float = 0.1) -> float:
    """Share of requests meeting both SLOs, leaving out the first and last `trim` of the stream
    (a system filling up from empty, or emptying once arrivals stop, is not the steady state)."""
    n = len(out.ttft)
    lo, hi = int(n * trim), n - int(n * trim)
    ok = (out.ttft[lo:hi] <= slo.ttft) & (out.tpot[lo:hi] <= slo.tpot)
    return float(np.mean(ok)) if hi > lo else 0.0


def max_rate(
    attain_at: Callable[[float], float], guess: float, target: float = TARGET, iters: int = 10
) -> float:
    """Highest rate whose attainment is >= target, by doubling from `guess` to bracket it, then
    bisection (attainment falls as the rate rises); 0 when even a trickle misses."""
    lo, hi = 0.0, guess
    for _ in range(20):
        if attain_at(hi) < target:
            break
        lo, hi = hi, hi * 2
    else:
        return hi
    floor = guess / 1024
    if lo == 0.0 and attain_at(floor) < target:
        return 0.0
    lo = max(lo, floor)
    for _ in range(iters):
        mid = (lo + hi) / 2
        if attain_at(mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo
