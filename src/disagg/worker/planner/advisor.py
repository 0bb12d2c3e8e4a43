"""How many prefill and decode replicas: the split of a replica budget that serves the most
requests within the SLOs (DistServe's placement search, on the simulated deployment), against
the same number of colocated replicas. Two kinds of split are searched: DistServe's (decode
replicas never prefill, prefill replicas never decode: `simulate.disaggregated`) and the one this
product serves (decode workers prefill where cheaper, the router lends idle prefill workers whole
requests: `routing.simulate`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from disagg.worker.engine.args import EngineArgs
from disagg.worker.planner import routing, simulate
from disagg.worker.planner.goodput import SLO, attainment, max_rate
from disagg.worker.planner.profile import Profile
from disagg.worker.planner.simulate import Outcome
from disagg.worker.planner.workload import Requests, Workload
from disagg.worker.serving.args import ServingArgs


@dataclass(frozen=True)
class Settings:
    # what the workers run: the engine's and the serving settings' own defaults
    max_batch: int = EngineArgs.max_num_seqs  # decode batch cap
    chunk_tokens: int = EngineArgs.max_num_batched_tokens  # colocated prefill chunk
    # Simulated arrivals span this many unloaded lifetimes of the workload's longest request, so
    # that queues reach their steady state before the stream ends (bounded by max_requests).
    horizon_lifetimes: float = 20.0
    min_requests: int = 600
    max_requests: int = 60_000
    seed: int = 0
    # Instead of the steady state: streams of `window_seconds` of arrivals, as a benchmark sends
    # (bench/serve.py's --duration), attainment averaged over `windows` seeds. Near the knee a
    # short window attains far more than the steady state: queues have no time to build.
    window_seconds: float | None = None
    windows: int = 1
    # the served split's policies: the router's --prefill-overflow margin (None: off), the decode
    # workers' --disagg-threshold, --prefill-placement and --disagg-busy-slack
    overflow_margin: float | None = None
    disagg_threshold: int = ServingArgs.disagg_threshold
    prefill_placement: str = ServingArgs.prefill_placement
    disagg_busy_slack: float = ServingArgs.disagg_busy_slack


@dataclass(frozen=True)
class Plan:
    replicas: int
    prefill: int
    decode: int
    disaggregated: float  # goodput, requests/s
    colocated: float
    served: float = 0.0  # the best served split's goodput ...
    served_prefill: int = 0  # ... and its replicas per role
    served_decode: int = 0

    @property
    def ratio(self) -> float:
        return self.disaggregated / self.colocated if self.colocated else float("inf")

    @property
    def served_ratio(self) -> float:
        return self.served / self.colocated if self.colocated else float("inf")


def _requests(prof: Profile, workload: Workload, rate: float, s: Settings, seed: int = 0) -> Requests:
    if s.window_seconds is not None:
        return workload.sample(max(8, int(rate * s.window_seconds)), rate, seed)
    lifetime = float(prof.prefill_seconds(workload.longest_prompt)) + workload.output_tokens[1] * float(
        prof.step_seconds(1)
    )
    n = int(np.clip(rate * s.horizon_lifetimes * lifetime, s.min_requests, s.max_requests))
    return workload.sample(n, rate, seed)


def _attainment_at(
    run: Callable[[Requests], Outcome], prof: Profile, workload: Workload, slo: SLO, s: Settings
) -> Callable[[float], float]:
    """Attainment as a function of the rate, for `max_rate`: one steady-state stream, or the mean
    over `s.windows` benchmark-length ones."""
    count = s.windows if s.window_seconds is not None else 1

    def attain(rate: float) -> float:
        return float(np.mean([attainment(run(_requests(prof, workload, rate, s, s.seed + k)), slo)
                              for k in range(count)]))  # fmt: skip

    return attain


def goodput_disaggregated(
    prof: Profile, workload: Workload, slo: SLO, prefill: int, decode: int, s: Settings
) -> float:
    def run(req: Requests) -> Outcome:
        return simulate.disaggregated(prof, req, prefill, decode, s.max_batch)

    attain = _attainment_at(run, prof, workload, slo, s)
    return max_rate(attain, guess=_capacity_guess(prof, workload, prefill, decode, s))


def goodput_served(
    prof: Profile, workload: Workload, slo: SLO, prefill: int, decode: int, s: Settings
) -> float:
    """Goodput of `prefill` + `decode` replicas under the product's routing and placement."""

    def run(req: Requests) -> Outcome:
        return routing.simulate(prof, req, prefill, decode, s.overflow_margin, s.max_batch, s.chunk_tokens,
                                s.prefill_placement, s.disagg_threshold, s.disagg_busy_slack)  # fmt: skip

    attain = _attainment_at(run, prof, workload, slo, s)
    return max_rate(attain, guess=_colocated_guess(prof, workload, prefill + decode))


def _colocated_guess(prof: Profile, workload: Workload, replicas: int) -> float:
    per = 1.0 / (
        float(prof.prefill_seconds(workload.mean_prompt)) + workload.mean_output * float(prof.step_seconds(1))
    )
    return per * replicas


def goodput_colocated(prof: Profile, workload: Workload, slo: SLO, replicas: int, s: Settings) -> float:
    def run(req: Requests) -> Outcome:
        return simulate.colocated(prof, req, replicas, s.max_batch, s.chunk_tokens)

    attain = _attainment_at(run, prof, workload, slo, s)
    return max_rate(attain, guess=_colocated_guess(prof, workload, replicas))


def _phase_rates(prof: Profile, workload: Workload, s: Settings) -> tuple[float, float]:
    """Requests/s one prefill replica and one decode replica can sustain (throughput bounds)."""
    prefill = 1.0 / float(prof.prefill_seconds(workload.mean_prompt))
    batch = s.max_batch
    held = batch * simulate.decode_context(workload.mean_prompt, workload.mean_output)
    decode = batch / (prof.decode_seconds(batch, held) * max(workload.mean_output - 1, 1))
    return prefill, decode


def _capacity_guess(prof: Profile, workload: Workload, prefill: int, decode: int, s: Settings) -> float:
    p, d = _phase_rates(prof, workload, s)
    return 0.5 * min(prefill * p, decode * d)


def split_candidates(
    prof: Profile, workload: Workload, replicas: int, s: Settings, width: int = 2
) -> list[int]:
    """Prefill replica counts worth simulating: around the split that balances the two phases'
    throughput (n_p * prefill rate = n_d * decode rate)."""
    p, d = _phase_rates(prof, workload, s)
    centre = int(round(replicas * d / (p + d)))
    return sorted({int(np.clip(centre + k, 1, replicas - 1)) for k in range(-width, width + 1)})


def advise(
    prof: Profile, workload: Workload, slo: SLO, replicas: int, s: Settings = Settings(), served: bool = True
) -> Plan:
    """The best DistServe split of `replicas` and, unless `served` is False, the best served split."""
    if replicas < 2:
        raise ValueError("a disaggregated deployment needs at least 2 replicas")
    splits = split_candidates(prof, workload, replicas, s)
    best = max((goodput_disaggregated(prof, workload, slo, n, replicas - n, s), n) for n in splits)
    best_served = (0.0, 0)
    if served:
        best_served = max((goodput_served(prof, workload, slo, n, replicas - n, s), n) for n in splits)
    return Plan(
        replicas, best[1], replicas - best[1], best[0], goodput_colocated(prof, workload, slo, replicas, s),
        best_served[0], best_served[1], replicas - best_served[1] if served else 0,
    )  # fmt: skip
