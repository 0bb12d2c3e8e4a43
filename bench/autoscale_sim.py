"""Autoscaler vs the best static pools: a discrete-event simulation driven by engine measurements.

    .venv/bin/python bench/autoscale_sim.py                 # measure once, cache, simulate
    .venv/bin/python bench/autoscale_sim.py --remeasure     # measure the engine again
    .venv/bin/python bench/autoscale_sim.py --profile FILE  # use a saved measurement

Per-replica service times come from the real engine on this machine (`disagg.worker.LLM` on a
checkpoint written by `make_model`): prefill seconds as a function of prompt tokens, and decode
step seconds as a function of the batch size. The measurement is cached in
`.run/autoscale_profile.json`.

The simulated system: a router assigns each prompt to the prefill replica that frees up first
(FIFO per replica, one prompt at a time); the first token leaves when the prompt is done; the
request then joins the decode replica with the fewest running requests, which advances all its
requests one token per step of measured duration (continuous batching, up to `--max-batch`).
New replicas serve after `--startup` seconds; removed prefill replicas finish their queue,
removed decode replicas drain their streams, and both are paid for until then.

The trace is a bursty day: a diurnal rate curve (night trough at 15% of the peak, a morning
shoulder, an afternoon peak) over `--hours` (24 by default; fewer compresses the day), plus
random bursts of 1.5-2.5x lasting 3-10 minutes, about one every 90 minutes of the day. The autoscaler is the real control law
(`disagg.operator.autoscaling.control.decide`) fed the same windowed percentiles it computes in
production (histogram buckets, PromQL semantics), ticking every 15 s. The static baseline gets
the autoscaler's average replica count, rounded up (equal or higher cost), split between the
pools every way within `--split-radius` of the autoscaler's own split; the best split is shown. Printed: SLO attainment (requests meeting both the TTFT and the ITL target),
TTFT/ITL p90, and replica-hours.
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from disagg.operator.autoscaling.control import Memory, Observation, Tuning, decide
from disagg.operator.autoscaling.metrics import Histogram, quantile
from disagg.operator.autoscaling.spec import parse_autoscaling
from disagg.worker.planner import profile as profiles
from disagg.worker.planner.profile import Profile

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROFILE = ROOT / ".run" / "autoscale_profile.json"
MODEL_DIR = ROOT / ".models"
# The workers' latency buckets (worker/metrics.py), so the simulated percentiles carry the
# same interpolation error as the real ones.
BUCKETS = np.array(
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
     1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 120.0, math.inf]
)  # fmt: skip


# ----------------------------------------------------------------------------- measurement


def measure(preset: str) -> dict:
    """The engine profile (planner's measurement) on a checkpoint of the preset."""
    from disagg.worker.tools.make_model import make_model

    data = profiles.measure(make_model(MODEL_DIR / f"autoscale-{preset}", preset=preset, seed=0))
    return {"preset": preset, **data}


def load_profile(args) -> tuple[Profile, dict]:
    if args.profile:
        return profiles.load(args.profile)
    if DEFAULT_PROFILE.exists() and not args.remeasure:
        return profiles.load(DEFAULT_PROFILE)
    print(f"measuring the engine ({args.preset} preset) ...", file=sys.stderr)
    data = measure(args.preset)
    profiles.save(data, DEFAULT_PROFILE)
    return Profile.from_json(data), data


# ----------------------------------------------------------------------------- trace


@dataclass
class Trace:
    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    duration: float


def day_rate(t, duration: float) -> np.ndarray:
    """Requests/s relative to the peak: a night trough at 15%, an afternoon peak at 100%."""
    hour = 24.0 * np.asarray(t) / duration
    return 0.15 + 0.85 * np.clip(
        np.exp(-(((hour - 15.0) / 4.5) ** 2)) + 0.35 * np.exp(-(((hour - 10.0) / 2.0) ** 2)), 0, 1
    )


def make_trace(peak_rate: float, duration: float, seed: int, prompt_mean: float, output_mean: float) -> Trace:
    rng = np.random.default_rng(seed)
    # Bursts: about one every 90 minutes of the day, 1.5-2.5x for 3-10 minutes.
    scale = duration / 86400.0
    bursts = []
    t = rng.exponential(5400.0 * scale)
    while t < duration:
        bursts.append((t, t + rng.uniform(180, 600), rng.uniform(1.5, 2.5)))
        t += rng.exponential(5400.0 * scale)
    grid = np.arange(0.0, duration, 1.0)
    rate = peak_rate * day_rate(grid, duration)
    for start, end, factor in bursts:
        rate[(grid >= start) & (grid < end)] *= factor
    counts = rng.poisson(rate)
    arrival = np.repeat(grid, counts) + rng.uniform(0, 1, counts.sum())
    arrival.sort()
    n = len(arrival)
    prompt = np.clip(rng.lognormal(math.log(prompt_mean) - 0.18, 0.6, n), 16, 4 * prompt_mean).astype(int)
    output = np.clip(rng.lognormal(math.log(output_mean) - 0.18, 0.6, n), 4, 4 * output_mean).astype(int)
    return Trace(arrival, prompt, output, duration)


# ----------------------------------------------------------------------------- simulation


@dataclass
class Replica:
    created: float
    ready_at: float
    removed: float | None = None  # when it was told to go (it still finishes its work)
    gone: float | None = None  # when it stopped costing
    free_at: float = 0.0  # prefill: when its queue empties
    active: int = 0  # decode: running requests


@dataclass
class Result:
    label: str
    attainment: float
    ttft_ok: float
    itl_ok: float
    ttft_p90: float
    itl_p90: float
    prefill_hours: float
    decode_hours: float
    changes: int = 0
    peak: tuple[int, int] = (0, 0)

    @property
    def replica_hours(self) -> float:
        return self.prefill_hours + self.decode_hours


def bucket_counts(values, weights=None) -> np.ndarray:
    idx = np.searchsorted(BUCKETS, np.asarray(values, dtype=float), side="left")
    return np.bincount(idx, weights=weights, minlength=len(BUCKETS))[: len(BUCKETS)].astype(float)


def to_histogram(counts: np.ndarray) -> Histogram | None:
    if counts.sum() <= 0:
        return None
    return Histogram(tuple(zip(BUCKETS.tolist(), np.cumsum(counts).tolist(), strict=True)))


class Simulation:
    TICK = 15.0
    WINDOW = 60.0

    def __init__(self, trace: Trace, prof: Profile, args, static: tuple[int, int] | None = None):
        self.trace, self.prof, self.args, self.static = trace, prof, args, static
        self.dt = args.dt
        self.tuning = Tuning(window_seconds=self.WINDOW)
        top = args.max_replicas
        self.specs = {
            "prefill": parse_autoscaling(
                "prefill",
                {"minReplicas": 1, "maxReplicas": top, "target": {"ttftMilliseconds": args.ttft_ms}},
            ),
            "decode": parse_autoscaling(
                "decode", {"minReplicas": 1, "maxReplicas": top, "target": {"itlMilliseconds": args.itl_ms}}
            ),
        }
        n_p, n_d = static or (1, 1)
        self.prefill = [Replica(0.0, 0.0) for _ in range(n_p)]
        self.decode = [Replica(0.0, 0.0) for _ in range(n_d)]
        self.memory = {"prefill": Memory(), "decode": Memory()}
        n = len(trace.arrival)
        self.prefill_done = np.full(n, np.inf)
        self.first_token = np.full(n, np.inf)
        self.itl_sum = np.zeros(n)
        self.finished = np.zeros(n, dtype=bool)
        self.next_arrival = 0
        self.waiting_starts: list[float] = []  # prefill start times still ahead (the queue)
        self.to_decode: list[tuple[float, int]] = []  # (prefill done, request)
        self.decode_queue: deque[int] = deque()
        self.ttft_seen: deque[tuple[float, float]] = deque()  # (first token time, ttft)
        self.itl_seen: deque[tuple[float, np.ndarray]] = deque()  # (time, bucket counts by tokens)
        self.run_req = np.zeros(0, dtype=int)
        self.run_srv = np.zeros(0, dtype=int)
        self.run_left = np.zeros(0)
        self.changes = 0
        self.peak = [n_p, n_d]

    # -- pools
    def live(self, pool: list[Replica]) -> list[Replica]:
        return [r for r in pool if r.removed is None]

    def observe(self, t: float) -> dict[str, Observation]:
        while self.ttft_seen and self.ttft_seen[0][0] <= t - self.WINDOW:
            self.ttft_seen.popleft()
        while self.itl_seen and self.itl_seen[0][0] <= t - self.WINDOW:
            self.itl_seen.popleft()
        while self.waiting_starts and self.waiting_starts[0] <= t:
            heapq.heappop(self.waiting_starts)
        ttft_counts = bucket_counts([v for _, v in self.ttft_seen])
        itl_counts = sum((c for _, c in self.itl_seen), np.zeros(len(BUCKETS)))
        ready = [r for r in self.live(self.decode) if r.ready_at <= t]
        kv = float(np.mean([r.active for r in ready]) / self.args.max_batch) if ready else 0.0
        return {
            "prefill": Observation(
                t, quantile(self.specs["prefill"].quantile, to_histogram(ttft_counts)), float(ttft_counts.sum()),
                queue_waiting=float(len(self.waiting_starts)),
            ),
            "decode": Observation(
                t, quantile(self.specs["decode"].quantile, to_histogram(itl_counts)), float(itl_counts.sum()),
                kv_usage=kv,
            ),
        }  # fmt: skip

    def autoscale(self, t: float) -> None:
        obs = self.observe(t)
        for role, pool in (("prefill", self.prefill), ("decode", self.decode)):
            live = self.live(pool)
            ready = sum(r.ready_at <= t for r in live)
            d = decide(self.specs[role], len(live), ready, obs[role], self.memory[role], t, self.tuning)
            self.memory[role] = d.memory
            if d.replicas > len(live):
                pool.extend(Replica(t, t + self.args.startup, free_at=t + self.args.startup)
                            for _ in range(d.replicas - len(live)))  # fmt: skip
            elif d.replicas < len(live):
                # Prefer replicas still starting, then the least busy; they finish what they hold.
                order = sorted(
                    live, key=lambda r: (r.ready_at <= t, r.free_at if role == "prefill" else r.active)
                )
                for r in order[: len(live) - d.replicas]:
                    r.removed = t
            self.changes += d.changed
        self.peak = [
            max(self.peak[0], len(self.live(self.prefill))),
            max(self.peak[1], len(self.live(self.decode))),
        ]

    def assign_prompts(self, t: float, end: float) -> None:
        """Prompts arriving in [t, end) go to the prefill replica that frees up first."""
        trace, live = self.trace, self.live(self.prefill)
        heap = [(max(r.free_at, r.ready_at), k) for k, r in enumerate(live)]
        heapq.heapify(heap)
        while self.next_arrival < len(trace.arrival) and trace.arrival[self.next_arrival] < end:
            i = self.next_arrival
            arrival = trace.arrival[i]
            free, k = heapq.heappop(heap)
            begin = max(arrival, free)
            done = begin + self.prof.prefill_seconds(trace.prompt[i])
            live[k].free_at = done
            heapq.heappush(heap, (done, k))
            if begin > arrival:
                heapq.heappush(self.waiting_starts, begin)
            self.prefill_done[i] = done
            heapq.heappush(self.to_decode, (done, i))
            self.next_arrival += 1

    def admit(self, now: float) -> None:
        while self.to_decode and self.to_decode[0][0] <= now:
            self.decode_queue.append(heapq.heappop(self.to_decode)[1])
        if not self.decode_queue:
            return
        open_ = [k for k, r in enumerate(self.decode) if r.removed is None and r.ready_at <= now]
        req, srv = [], []
        while self.decode_queue and open_:
            k = min(open_, key=lambda k: self.decode[k].active)
            if self.decode[k].active >= self.args.max_batch:
                break
            i = self.decode_queue.popleft()
            # Admitted at its first chance: the first token left with the prefill. Otherwise it
            # waited for a decode slot (the decode worker admits before the prefill starts).
            first = self.prefill_done[i] if now - self.prefill_done[i] <= self.dt else now
            self.first_token[i] = first
            self.ttft_seen.append((first, first - self.trace.arrival[i]))
            self.decode[k].active += 1
            req.append(i)
            srv.append(k)
        if req:
            req = np.array(req)
            self.run_req = np.concatenate([self.run_req, req])
            self.run_srv = np.concatenate([self.run_srv, np.array(srv)])
            self.run_left = np.concatenate([self.run_left, self.trace.output[req].astype(float)])

    def decode_step(self, now: float) -> None:
        """Advance every running request by dt of continuous batching on its replica."""
        if not len(self.run_req):
            return
        batch = np.bincount(self.run_srv, minlength=len(self.decode))
        step = self.prof.step_seconds(batch)
        per_req = step[self.run_srv]
        tokens = np.minimum(self.dt / per_req, self.run_left)
        self.run_left -= tokens
        self.itl_sum[self.run_req] += per_req * tokens
        used = batch > 0
        self.itl_seen.append((now, bucket_counts(step[used], (batch * self.dt / step)[used])))
        done = self.run_left <= 1e-9
        if done.any():
            for k in self.run_srv[done]:
                self.decode[k].active -= 1
            self.finished[self.run_req[done]] = True
            keep = ~done
            self.run_req, self.run_srv, self.run_left = (
                self.run_req[keep],
                self.run_srv[keep],
                self.run_left[keep],
            )

    def run(self, label: str) -> Result:
        t, horizon = 0.0, self.trace.duration
        while t < horizon or (len(self.run_req) or self.to_decode or self.decode_queue) and t < horizon + 900:
            if self.static is None and t > 0:
                self.autoscale(t)
            if self.args.timeline and self.static is None and t % (60 * self.args.timeline) < self.TICK:
                self.print_timeline(t)
            end = t + self.TICK
            self.assign_prompts(t, end)
            step_t = t
            while step_t < end - 1e-9:
                step_t += self.dt
                self.admit(step_t)
                self.decode_step(step_t)
            for r in self.decode:
                if r.removed is not None and r.gone is None and r.active == 0:
                    r.gone = end
            t = end
        return self.result(label, t)

    def print_timeline(self, t: float) -> None:
        obs = self.observe(t)
        recent = np.sum((self.trace.arrival > t - 60) & (self.trace.arrival <= t)) / 60
        ttft, itl = obs["prefill"].latency_seconds, obs["decode"].latency_seconds
        print(f"  t={t / 3600:5.2f}h {recent:6.2f} req/s  P={len(self.live(self.prefill)):2d} "
              f"D={len(self.live(self.decode)):2d}  TTFT p90 {1000 * (ttft or 0):6.0f}ms  "
              f"ITL p90 {1000 * (itl or 0):5.0f}ms  queue {obs['prefill'].queue_waiting:.0f}")  # fmt: skip

    def result(self, label: str, end: float) -> Result:
        out = self.trace.output.astype(float)
        ttft = self.first_token - self.trace.arrival
        itl = np.where(self.finished, self.itl_sum / np.maximum(out, 1), np.inf)
        ttft_ok = ttft <= self.args.ttft_ms / 1000
        itl_ok = itl <= self.args.itl_ms / 1000
        horizon = self.trace.duration

        def hours(pool, prefill):
            total = 0.0
            for r in pool:
                stop = r.gone if r.gone is not None else horizon
                if prefill and r.removed is not None:
                    stop = max(r.removed, min(r.free_at, end))
                total += max(0.0, min(stop, horizon) - r.created)
            return total / 3600

        done = self.finished
        return Result(
            label=label,
            attainment=float(np.mean(ttft_ok & itl_ok)),
            ttft_ok=float(np.mean(ttft_ok)),
            itl_ok=float(np.mean(itl_ok)),
            ttft_p90=float(np.percentile(ttft[np.isfinite(ttft)], 90)),
            itl_p90=float(np.percentile(itl[done], 90)) if done.any() else math.inf,
            prefill_hours=hours(self.prefill, True),
            decode_hours=hours(self.decode, False),
            changes=self.changes,
            peak=tuple(self.peak),
        )


# ----------------------------------------------------------------------------- main


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", help="a saved measurement (JSON) instead of measuring")
    p.add_argument("--remeasure", action="store_true", help=f"measure again and rewrite {DEFAULT_PROFILE}")
    p.add_argument("--preset", default="small", help="make_model preset to measure (default small)")
    p.add_argument("--hours", type=float, default=24.0, help="simulated length of the day (default 24)")
    p.add_argument("--peak-replicas", type=float, default=8.0,
                   help="peak load, in replicas of the busier pool kept 70%% busy (default 8)")  # fmt: skip
    p.add_argument("--prompt-tokens", type=float, default=512.0, help="mean prompt length")
    p.add_argument("--output-tokens", type=float, default=64.0, help="mean output length")
    p.add_argument("--ttft-ms", type=float, help="TTFT target (default 4x the mean prompt's prefill time)")
    p.add_argument("--itl-ms", type=float, help="ITL target (default the step time at batch 16)")
    p.add_argument("--startup", type=float, default=60.0, help="seconds before a new replica serves")
    p.add_argument("--max-batch", type=int, default=64, help="requests a decode replica holds (KV capacity)")
    p.add_argument("--max-replicas", type=int, default=24, help="autoscaler maxReplicas per role")
    p.add_argument("--dt", type=float, default=1.0, help="decode time step of the simulation, seconds")
    p.add_argument(
        "--split-radius", type=int, default=2, help="static splits tried each side of the autoscaler's"
    )
    p.add_argument(
        "--timeline", type=float, default=0, metavar="MIN", help="print the pools every MIN minutes"
    )
    p.add_argument("--seed", type=int, default=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    prof, raw = load_profile(args)
    mean_prefill = float(prof.prefill_seconds(args.prompt_tokens))
    args.ttft_ms = args.ttft_ms or round(4000 * mean_prefill, 1)
    args.itl_ms = args.itl_ms or round(1000 * float(prof.step_seconds(16)), 1)
    # The peak keeps both pools at about --peak-replicas busy 70% of the time: prefill at the mean
    # prompt's prefill time, decode at batch 16 (the default ITL target's step time).
    decode_rate = 16 / (float(prof.step_seconds(16)) * args.output_tokens)
    peak_rate = args.peak_replicas * 0.7 * min(1 / mean_prefill, decode_rate)
    trace = make_trace(peak_rate, args.hours * 3600, args.seed, args.prompt_tokens, args.output_tokens)

    print(f"engine profile ({raw.get('preset')}, {raw.get('machine', '?')}, {raw.get('measured_at', '?')}):")
    print(f"  prefill {1000 * prof.prefill_fixed:.1f} ms + {1e6 * prof.prefill_per_token:.1f} us/token "
          f"({args.prompt_tokens:.0f}-token prompt: {1000 * mean_prefill:.0f} ms)")  # fmt: skip
    steps = ", ".join(
        f"B={int(b)} {1000 * s:.1f}ms" for b, s in zip(prof.decode_batches, prof.decode_steps, strict=True)
    )
    print(f"  decode step: {steps}")
    print(f"trace: {len(trace.arrival)} requests over {args.hours:g} h, peak {peak_rate:.2f} req/s "
          f"plus bursts; prompts ~{args.prompt_tokens:.0f} tokens, outputs ~{args.output_tokens:.0f}")  # fmt: skip
    print(f"SLO: TTFT p90 <= {args.ttft_ms:g} ms and ITL <= {args.itl_ms:g} ms per request; "
          f"replicas start in {args.startup:g} s")  # fmt: skip

    t0 = time.perf_counter()
    auto = Simulation(trace, prof, args).run("autoscaler")
    budget = math.ceil(auto.replica_hours / args.hours - 1e-9)
    # Splits around the autoscaler's own prefill:decode ratio (attainment is unimodal in the split).
    centre = round(budget * auto.prefill_hours / auto.replica_hours)
    splits = [p for p in range(centre - args.split_radius, centre + args.split_radius + 1) if 1 <= p < budget]
    statics = [Simulation(trace, prof, args, static=(p, budget - p)).run(f"static {p}P+{budget - p}D")
               for p in splits]  # fmt: skip
    best = max(statics, key=lambda r: (r.attainment, -r.replica_hours))
    elapsed = time.perf_counter() - t0

    print(f"\n{'':22s} {'SLO attain':>10s} {'TTFT ok':>8s} {'ITL ok':>8s} {'TTFT p90':>9s} {'ITL p90':>8s} "
          f"{'replica-h':>9s} {'prefill-h':>9s} {'decode-h':>9s}")  # fmt: skip
    for r in (auto, best):
        print(f"{r.label:22s} {r.attainment:10.1%} {r.ttft_ok:8.1%} {r.itl_ok:8.1%} {1000 * r.ttft_p90:7.0f}ms "
              f"{1000 * r.itl_p90:6.0f}ms {r.replica_hours:9.1f} {r.prefill_hours:9.1f} {r.decode_hours:9.1f}")  # fmt: skip
    print(f"\nautoscaler: {auto.changes} scale changes, peak {auto.peak[0]} prefill + {auto.peak[1]} decode; "
          f"static budget {budget} replicas, splits {splits[0]}..{splits[-1]}P tried, best shown")  # fmt: skip
    print(f"attainment {auto.attainment:.1%} vs {best.attainment:.1%} "
          f"({auto.attainment - best.attainment:+.1%}), replica-hours {auto.replica_hours:.1f} vs "
          f"{best.replica_hours:.1f} (x{auto.replica_hours / best.replica_hours:.2f}); simulated in {elapsed:.0f}s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
