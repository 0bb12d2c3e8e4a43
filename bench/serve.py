"""Serving benchmark: goodput of colocated vs disaggregated workers on the same cores.

Goodput as DistServe defines it: the highest request rate at which >= 90% of requests meet both
a TTFT SLO and a TPOT SLO (mean time between output tokens after the first). For each workload
(chat: short prompts, long outputs; summarization: long prompts, short outputs) the SLOs are
multiples ("SLO scale") of the unloaded single-request latency measured first; then each
deployment -- (a) 2 x `--role both`, (b) 1 prefill + 1 decode, (c) the same 1P+1D whose router
lends the unqueued prefill worker whole requests when the decode worker is busier by more than
`--overflow-margin` requests (`--prefill-overflow`), every worker pinned to its own core with one
torch thread -- is driven by an open-loop Poisson stream at a few rates (doubling, then bisection
on the base scale), and the SLO attainment of every rate is printed for every scale, with the
goodput of each deployment and its ratio to colocated. A PNG beside the table plots
attainment against rate. The planner's prediction (`disagg plan`, from an engine profile
measured on one core in the same command) is printed beside each layout's measured goodput: the
colocated pair's, and each 1P+1D layout's as served (its placement and overflow policies,
simulated: planner/routing.py). After each rate, every worker's engine busy share, decode batch
and step time (its step metrics) say whether the engine or the time around it is the bound.
Attainment over fewer than ~60 requests per rate moves by tens of points between runs near the
knee: compare layouts with --duration 80 or more.

    python bench/serve.py --preset small                      # both workloads, 4 rates each
    python bench/serve.py --workloads chat --points 3 --duration 80 --start-rate 0.8
    python bench/serve.py --interference --rate 0.5           # the prefill-interference comparison
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import numpy as np
from bench_model import ensure_model  # noqa: E402

from disagg.worker.cli.flags import Up
from disagg.worker.cli.ports import free_port
from disagg.worker.cli.up import Deployment, add_arguments
from disagg.worker.engine.args import EngineArgs
from disagg.worker.planner.advisor import Settings, goodput_colocated, goodput_served
from disagg.worker.planner.goodput import BASE_SCALE, SLO, SLO_SCALES, TARGET, attainment
from disagg.worker.planner.profile import Profile
from disagg.worker.planner.simulate import Outcome
from disagg.worker.planner.workload import WORKLOADS, Workload
from disagg.worker.router.args import RouterArgs
from disagg.worker.serving.args import ServingArgs


@dataclass
class Result:
    kind: str
    ok: bool = False
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    tokens: int = 0
    error: str = ""


def workload(args) -> list[tuple[float, str, list[int], int]]:
    """(arrival offset s, kind, prompt token ids, max_tokens) for every request, fixed by the seed."""
    rng = random.Random(args.seed)
    out, t = [], 0.0
    while t < args.duration:
        t += rng.expovariate(args.rate)
        if rng.random() < args.long_fraction:
            kind, n_prompt, n_out = "long-prompt", args.long_prompt, args.short_output
        else:
            kind, n_prompt, n_out = "long-output", args.short_prompt, args.long_output
        n_prompt = max(1, int(n_prompt * rng.uniform(0.8, 1.2)))
        out.append((t, kind, [rng.randrange(10, 1000) for _ in range(n_prompt)], n_out))
    return out


async def one(session, url, model, kind, prompt, max_tokens) -> Result:
    res = Result(kind)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    start = time.perf_counter()
    last = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if not chunk["choices"] or not chunk["choices"][0]["text"]:
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
                res.tokens += 1
    except (aiohttp.ClientError, TimeoutError) as e:
        res.error = str(e)
        return res
    res.e2e = time.perf_counter() - start
    res.ok = True
    return res


async def drive(url: str, model: str, plan, precache: bool = False) -> tuple[list[Result], float]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        # warm up both paths (first handshake, first allocations) outside the measurement
        await asyncio.gather(*(one(session, url, model, "warmup", p, 4) for _t, _k, p, _n in plan[:2]))
        if precache:
            # prefill every long prompt once beforehand: in the measured run their prefill is a
            # prefix-cache hit (one token) while their decode work is unchanged
            long_prompts = [p for _t, kind, p, _n in plan if kind == "long-prompt"]
            for i in range(0, len(long_prompts), 2):
                await asyncio.gather(
                    *(one(session, url, model, "warmup", p, 1) for p in long_prompts[i : i + 2])
                )
        start = time.perf_counter()
        tasks = []
        for offset, kind, prompt, n in plan:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, url, model, kind, prompt, n)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[Result], wall: float, args) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itls]
    decode_itl = [x for r in ok if r.kind == "long-output" for x in r.itls]
    good = [
        r for r in ok if r.ttft <= args.ttft_slo and (not r.itls or statistics.fmean(r.itls) <= args.itl_slo)
    ]
    s = {
        "requests ok": len(ok),
        "requests failed": len(results) - len(ok),
        "TTFT p50 (ms)": pct(ttft, 50) * 1e3,
        "TTFT p90 (ms)": pct(ttft, 90) * 1e3,
        "TTFT p99 (ms)": pct(ttft, 99) * 1e3,
        "ITL p50 (ms)": pct(itl, 50) * 1e3,
        "ITL p90 (ms)": pct(itl, 90) * 1e3,
        "ITL p99 (ms)": pct(itl, 99) * 1e3,
        "ITL p99 long-output (ms)": pct(decode_itl, 99) * 1e3,
        "throughput (out tok/s)": sum(r.tokens for r in ok) / wall,
        "throughput (req/s)": len(ok) / wall,
        "goodput (req/s)": len(good) / wall,
    }
    return s


def deployed_threshold(args) -> int:
    """The decode workers' --disagg-threshold: ours, else `disagg up`'s default."""
    if args.disagg_threshold is not None:
        return args.disagg_threshold
    up_parser = argparse.ArgumentParser()
    add_arguments(up_parser)
    return up_parser.get_default("disagg_threshold")


def deploy(
    args, name: str, prefill: int, decode: int, both: int, overflow: float | None = None
) -> Deployment:
    # through `disagg up`'s own parser: every setting not named here takes its default there
    up_parser = argparse.ArgumentParser()
    add_arguments(up_parser)
    serving = {"kv_transfer": args.kv_transfer}
    if args.disagg_threshold is not None:
        serving["disagg_threshold"] = args.disagg_threshold
    if args.prefill_placement:
        serving["prefill_placement"] = args.prefill_placement
    ns = up_parser.parse_args([
        Up.MODEL, str(args.model), Up.PREFILL, str(prefill), Up.DECODE, str(decode), Up.BOTH, str(both),
        Up.PORT, str(free_port()), *ServingArgs.cli_args(**serving),
        *EngineArgs.cli_args(threads=1, max_num_batched_tokens=args.max_num_batched_tokens),
        Up.RUN_DIR, str(Path(args.run_dir) / name), Up.TIMEOUT, "600",
        *(RouterArgs.cli_args(prefill_overflow=overflow) if overflow is not None else []),
    ])  # fmt: skip
    dep = Deployment(ns)
    dep.plan()
    cores = os.cpu_count() or 1
    if shutil.which("taskset") and cores >= 2:
        workers = [c for c in dep.children if c.name not in ("redis", "router")]
        for i, c in enumerate(workers):  # one core per worker: equal hardware in both layouts
            c.cmd = ["taskset", "-c", str(i % cores), *c.cmd]
    return dep


def run_one(
    args, name: str, prefill: int, decode: int, both: int, plan, precache: bool = False
) -> dict[str, float]:
    print(
        f"\n[{name}] starting {prefill} prefill + {decode} decode + {both} colocated workers ...", flush=True
    )
    dep = deploy(args, name, prefill, decode, both)
    try:
        dep.start()
        print(
            f"[{name}] ready; {len(plan)} requests over {args.duration:.0f}s at {args.rate}/s ...", flush=True
        )
        results, wall = asyncio.run(drive(dep.router_url, dep.model.name, plan, precache))
    finally:
        dep.stop()
    failed = [r.error for r in results if not r.ok]
    if failed:
        print(f"[{name}] {len(failed)} failed, e.g. {failed[0]}", flush=True)
    return summarize(results, wall, args)


def _ratio(num: float, den: float) -> float:
    return num / den if den and den == den and num == num else float("nan")


# ---------------------------------------------------------------------------- goodput sweep
# (prefill, decode, both, the router's --prefill-overflow margin): the same 2 cores. "overflow" is
# 1P+1D whose prefill worker also serves whole requests when the decode worker is busier.
LAYOUTS = {"colocated": (0, 0, 2, None), "disaggregated": (1, 1, 0, None), "overflow": (1, 1, 0, 2.0)}


def layouts(args) -> dict[str, tuple[int, int, int, float | None]]:
    """The layouts to sweep: colocated (the baseline) always, the others as --layouts names them."""
    names = ["colocated", *(n for n in args.layouts.split(",") if n and n != "colocated")]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown {', '.join(unknown)} (choose from {', '.join(LAYOUTS)})")
    out = {n: LAYOUTS[n] for n in names}
    if "overflow" in out:
        out["overflow"] = (*out["overflow"][:3], args.overflow_margin)
    return out


def rate_plan(wl: Workload, rate: float, duration: float, seed: int, vocab: int):
    """A Poisson stream of the workload's requests (fresh random prompts per seed: no prefix hits)."""
    req = wl.sample(max(8, int(rate * duration)), rate, seed)
    rng = random.Random(seed)
    return [
        (float(a), wl.name, [rng.randrange(10, vocab - 10) for _ in range(int(n))], int(o))
        for a, n, o in zip(req.arrival, req.prompt, req.output, strict=True)
    ]


def outcome(results: list[Result]) -> Outcome:
    """Per request in arrival order: TTFT and mean time per output token after the first (a failed
    request misses every SLO)."""
    ttft = [r.ttft if r.ok else math.inf for r in results]
    tpot = [
        (r.e2e - r.ttft) / (r.tokens - 1) if r.ok and r.tokens > 1 else (0.0 if r.ok else math.inf)
        for r in results
    ]
    return Outcome(np.array(ttft), np.array(tpot))


def measure_unloaded(dep: Deployment, wl: Workload, vocab: int) -> SLO:
    """SLO scale 1: the longest prompt of the workload, alone, the best of three."""
    plan = [(0.0, "unloaded", [random.Random(i).randrange(10, vocab - 10) for _ in range(wl.longest_prompt)],
             wl.output_tokens[1]) for i in range(3)]  # fmt: skip

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            return [await one(session, dep.router_url, dep.model.name, k, p, n) for _t, k, p, n in plan]

    runs = [r for r in asyncio.run(go()) if r.ok]
    if not runs:
        raise RuntimeError("the unloaded requests failed")
    out = outcome(runs)
    return SLO(float(out.ttft.min()), float(out.tpot.min()))


def sweep(
    args,
    name: str,
    layout,
    wl: Workload,
    slo: SLO,
    start: float,
    vocab: int,
    field: dict[float, float],
    prof: Profile | None = None,
):
    """Attainment at `args.points` rates: doubling (or halving) until the base scale's attainment
    crosses 90%, then bisection. With --aiperf, `field` gets aiperf's attainment at the base scale
    for each rate, from its own run right after ours."""
    dep = deploy(args, f"{wl.name}-{name}", *layout)
    tried: dict[float, Outcome] = {}
    try:
        dep.start()
        rate, passing, failing = start, None, None
        for i in range(args.points):
            plan = rate_plan(wl, rate, args.duration, args.seed + 1000 * len(tried) + 1, vocab)
            print(f"[{wl.name}/{name}] {rate:.3f} req/s: {len(plan)} requests over {args.duration:.0f}s "
                  f"(load {os.getloadavg()[0]:.1f}) ...", flush=True)  # fmt: skip
            counters = engine_counters(dep)
            results, wall = asyncio.run(drive(dep.router_url, dep.model.name, plan))
            for line in engine_summary(counters, engine_counters(dep), wall, prof):
                print(f"[{wl.name}/{name}]   {line}", flush=True)
            tried[rate] = outcome(results)
            ok = attainment(tried[rate], slo.scaled(BASE_SCALE)) >= TARGET
            failed = sum(not r.ok for r in results)
            base = slo.scaled(BASE_SCALE)
            print(f"[{wl.name}/{name}]   attainment at scale {BASE_SCALE:g}: "
                  f"{attainment(tried[rate], base):.0%} (TTFT alone {attainment(tried[rate], SLO(base.ttft, math.inf)):.0%}, "
                  f"TPOT alone {attainment(tried[rate], SLO(math.inf, base.tpot)):.0%})" + (f", {failed} failed" if failed else ""),
                  flush=True)  # fmt: skip
            if args.aiperf:
                out = Path(args.run_dir) / f"aiperf-{wl.name}-{name}-{len(tried)}"
                field[rate] = aiperf_attainment(args, dep, wl, rate, len(plan), slo.scaled(BASE_SCALE), out)
                print(f"[{wl.name}/{name}]   aiperf at the same rate: {field[rate]:.0%}", flush=True)
            if i == args.points - 1:
                break
            passing, failing = (rate, failing) if ok else (passing, rate)
            if passing is None:
                rate = failing / 2
            elif failing is None:
                rate = passing * 2
            else:
                rate = (passing + failing) / 2
    finally:
        dep.stop()
    return tried


ENGINE_SERIES = (
    "disagg_engine_step_seconds_sum",
    "disagg_engine_step_seconds_count",
    "disagg_engine_step_rows_total",
)


def engine_counters(dep: Deployment) -> dict[str, dict[tuple[str, str], float]]:
    """Each worker's engine step seconds, steps and rows by kind, from its /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = {}
    for child in dep.children:
        if child.name in ("redis", "router") or child.health_url is None:
            continue
        url = child.health_url.replace("/health", "/metrics")
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        counters[child.name] = {
            (s.name, s.labels["kind"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name in ENGINE_SERIES
        }
    return counters


def engine_summary(before: dict, after: dict, wall: float, prof: Profile | None) -> list[str]:
    """Per worker, over `wall` seconds: the share of time in engine steps by kind, and the decode
    steps' mean batch and time (beside the engine profile's time for that batch). A worker whose
    streams miss their TPOT while its engine is far from busy loses the time outside its steps."""
    lines = []
    for name in sorted(after):
        d = {k: v - before.get(name, {}).get(k, 0.0) for k, v in after[name].items()}
        busy = {
            kind: d.get(("disagg_engine_step_seconds_sum", kind), 0.0) / wall
            for kind in ("decode", "prefill")
        }
        line = f"{name}: engine busy {sum(busy.values()):.0%} (decode {busy['decode']:.0%}, prefill {busy['prefill']:.0%})"
        steps = d.get(("disagg_engine_step_seconds_count", "decode"), 0.0)
        if steps:
            batch = d.get(("disagg_engine_step_rows_total", "decode"), 0.0) / steps
            step = d[("disagg_engine_step_seconds_sum", "decode")] / steps
            line += f"; {steps:.0f} decode steps, mean batch {batch:.1f}, {1e3 * step:.1f} ms each"
            if prof is not None:
                line += f" (profile at a short context: {1e3 * float(prof.step_seconds(batch)):.1f} ms)"
        lines.append(line)
    return lines


def goodput_of(tried: dict[float, Outcome], slo: SLO) -> tuple[float, str]:
    return crossing({r: attainment(out, slo) for r, out in tried.items()})


def crossing(att_by_rate: dict[float, float]) -> tuple[float, str]:
    """The rate where attainment crosses 90%, interpolated between the tested rates around it;
    a bound ('>=' or '<') when the sweep did not bracket it."""
    rates = sorted(att_by_rate)
    att = [att_by_rate[r] for r in rates]
    passing = [i for i, a in enumerate(att) if a >= TARGET]
    if not passing:
        return 0.0, f"< {rates[0]:.3f}"
    i = max(passing)
    if i == len(rates) - 1:
        return rates[i], f">= {rates[i]:.3f}"
    r0, r1, a0, a1 = rates[i], rates[i + 1], att[i], att[i + 1]
    value = r0 + (r1 - r0) * (a0 - TARGET) / (a0 - a1) if a0 != a1 else r0
    return value, f"{value:.3f}"


def aiperf_attainment(
    args, dep: Deployment, wl: Workload, rate: float, count: int, slo: SLO, out: Path
) -> float:
    """The same rate driven by aiperf (the field's client) with DistServe goodput constraints:
    good requests / requests. Its synthetic prompts match the workload's length distribution."""
    spread = lambda lo, hi: (hi - lo) / math.sqrt(12)  # noqa: E731 - the stddev of a uniform range
    cmd = [
        args.aiperf, "profile", "--model", dep.model.name, "--url", dep.router_url, "--endpoint-type", "completions",
        "--streaming", "--tokenizer", str(dep.model), "--request-rate", f"{rate:.4f}", "--request-count", str(count),
        "--isl", str(int(wl.mean_prompt)), "--isl-stddev", f"{spread(*wl.prompt_tokens):.0f}",
        "--osl", str(int(wl.mean_output)), "--osl-stddev", f"{spread(*wl.output_tokens):.0f}",
        "--extra-inputs", "ignore_eos:true", "--random-seed", str(args.seed), "--ui-type", "none",
        "--goodput", f"time_to_first_token:{1e3 * slo.ttft:.1f} inter_token_latency:{1e3 * slo.tpot:.2f}",
        "--artifact-dir", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=30 * 60)
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    return report["good_request_count"]["avg"] / report["request_count"]["avg"]


def plot(path: Path, wl: Workload, base: SLO, curves: dict[str, dict[float, Outcome]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SLO_SCALES), figsize=(5 * len(SLO_SCALES), 4), sharey=True)
    for ax, scale in zip(axes, SLO_SCALES, strict=True):
        slo = base.scaled(scale)
        for name, tried in curves.items():
            rates = sorted(tried)
            ax.plot(rates, [100 * attainment(tried[r], slo) for r in rates], marker="o", label=name)
        ax.axhline(100 * TARGET, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{wl.name}, SLO scale {scale:g}\n{slo}", fontsize=9)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("SLO attainment (%)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def measure_profile(model: str, transfer_gbps: float) -> Profile:
    """The engine profile on one core with one thread, as each benchmarked worker runs."""
    code = ("import json, sys, torch; torch.set_num_threads(1); from disagg.worker.planner import profile; "
            "print(json.dumps(profile.measure(sys.argv[1], progress=lambda m: None)))")  # fmt: skip
    cmd = [sys.executable, "-c", code, model]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    data = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    return Profile.from_json({**data, "transfer_bytes_per_second": transfer_gbps * 1e9})


PREDICTION_WINDOWS = 8  # seeds averaged per rate for the planner's benchmark-length prediction


def predictions(args, prof: Profile, wl: Workload, slo: SLO, chosen: dict):
    """(layout, label, goodput in windows of the sweep's length, steady-state goodput) for each
    layout as deployed: the colocated pair, and each 1P+1D with its placement and overflow margin.
    The windowed figure is the one a sweep measures; near the knee it is well above the steady
    state (in one window, queues have no time to build)."""
    steady = Settings(
        max_batch=EngineArgs.max_num_seqs,
        chunk_tokens=args.max_num_batched_tokens,
        disagg_threshold=deployed_threshold(args),
        prefill_placement=args.prefill_placement,
    )
    windowed = replace(steady, window_seconds=args.duration, windows=PREDICTION_WINDOWS)

    def goodput(layout, s: Settings) -> float:
        if layout[2]:  # colocated workers
            return goodput_colocated(prof, wl, slo, layout[2], s)
        # 1P+1D as served: the deployment's placement and overflow margin
        return goodput_served(prof, wl, slo, layout[0], layout[1], replace(s, overflow_margin=layout[3]))

    out = []
    for name, layout in chosen.items():
        prefill, decode, both, margin = layout
        label = f"{both} colocated" if both else f"{prefill}P+{decode}D"
        if margin is not None:
            label += f" overflow {margin:g}"
        out.append((name, label, goodput(layout, windowed), goodput(layout, steady)))
    return out


def goodput_main(args) -> int:
    from disagg.worker.model.config import ModelConfig

    chosen = layouts(args)  # checked before anything is measured
    others = [name for name in chosen if name != "colocated"]
    vocab = ModelConfig.from_pretrained(args.model).vocab_size
    out_dir = Path(args.run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prof = None if args.no_prediction else measure_profile(args.model, args.transfer_gbps)
    if prof is not None:
        print(f"engine profile (one core): {prof.describe()}", flush=True)
    summary = []
    for wl_name in args.workloads.split(","):
        wl = WORKLOADS[wl_name]
        dep = deploy(args, f"{wl.name}-unloaded", *LAYOUTS["colocated"])
        try:
            dep.start()
            base = measure_unloaded(dep, wl, vocab)
        finally:
            dep.stop()
        print(f"[{wl.name}] unloaded latency (SLO scale 1): {base}", flush=True)
        start = args.start_rate or 0.5 * 2 / (base.ttft + wl.mean_output * base.tpot)
        field: dict[str, dict[float, float]] = {name: {} for name in chosen}
        curves = {
            name: sweep(args, name, chosen[name], wl, base, start, vocab, field[name], prof)
            for name in chosen
        }
        png = out_dir / f"goodput-{wl.name}.png"
        plot(png, wl, base, curves)
        print(f"\n[{wl.name}] SLO attainment by rate (req/s); plot: {png}")
        for scale in SLO_SCALES:
            slo = base.scaled(scale)
            print(f"  SLO scale {scale:g}: {slo}")
            found = {}
            for name, tried in curves.items():
                cells = "  ".join(f"{r:.3f}:{attainment(tried[r], slo):>4.0%}" for r in sorted(tried))
                found[name] = goodput_of(tried, slo)
                print(f"    {name:<14} {cells}   goodput {found[name][1]}")
            ratios = {
                name: found[name][0] / found["colocated"][0] if found["colocated"][0] else math.nan
                for name in others
            }
            line = "    " + "; ".join(f"{name} / colocated goodput: {r:.2f}" for name, r in ratios.items())
            if prof is not None:
                for name, label, window, steady in predictions(args, prof, wl, slo, chosen):
                    agree = f"measured/predicted {found[name][0] / window:.2f}" if window else "predicted 0"
                    line += (f"\n      planner: {label} {window:.3f} req/s in {args.duration:.0f} s windows ({agree}), "
                             f"{steady:.3f} in the steady state")  # fmt: skip
            print(line, flush=True)
            if args.aiperf and scale == BASE_SCALE:
                for name in chosen:
                    theirs = crossing(field[name])
                    ours = found[name][0]
                    agree = f"aiperf / ours {theirs[0] / ours:.2f}" if ours and theirs[0] else "not bracketed"
                    cells = "  ".join(f"{r:.3f}:{a:>4.0%}" for r, a in sorted(field[name].items()))
                    print(f"    aiperf {name:<14} {cells}   goodput {theirs[1]} ({agree})", flush=True)
            summary.append((wl.name, scale, {name: found[name][1] for name in chosen}, ratios))
    print(f"\n{'workload':<14}{'scale':>6}{'colocated':>12}" + "".join(f"{n:>15}{'ratio':>7}" for n in others)
          + "   (goodput, req/s)")  # fmt: skip
    for name, scale, cells, ratios in summary:
        print(f"{name:<14}{scale:>6g}{cells['colocated']:>12}"
              + "".join(f"{cells[n]:>15}{ratios[n]:>7.2f}" for n in others))  # fmt: skip
    print(f"\nworkers pinned one per core, torch threads 1, KV transfer {args.kv_transfer}, "
          f"{args.duration:.0f}s per rate, load {os.getloadavg()[0]:.1f} at end")  # fmt: skip
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: .models/<preset>, made if missing)")
    p.add_argument("--preset", choices=("tiny", "small"), default="tiny")
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--long-fraction", type=float, default=0.3, help="share of long-prompt requests")
    p.add_argument("--long-prompt", type=int, default=1536)
    p.add_argument("--short-output", type=int, default=8)
    p.add_argument("--short-prompt", type=int, default=64)
    p.add_argument("--long-output", type=int, default=128)
    p.add_argument("--ttft-slo", type=float, default=1.0, help="goodput: TTFT target (s)")
    p.add_argument("--itl-slo", type=float, default=0.05, help="goodput: mean ITL target (s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--disagg-threshold", type=int, default=None,
                   help="uncached prompt tokens below which the decode worker prefills locally (default: "
                        "`disagg up`'s for the goodput sweep; 256 for --interference, so its short "
                        "prompts stay local)")  # fmt: skip
    p.add_argument("--prefill-placement", choices=("load", "threshold"), default="load",
                   help="where the decode worker prefills (threshold: every long prompt remotely)")  # fmt: skip
    p.add_argument("--kv-transfer", choices=("nixl", "grpc"), default="nixl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default=".run/bench")
    p.add_argument("--interference", action="store_true",
                   help="instead of the goodput sweep: one rate, colocated vs disaggregated TTFT/ITL and "
                        "prefill interference")  # fmt: skip
    p.add_argument("--workloads", default="chat,summarization", help="goodput sweep: comma-separated")
    p.add_argument("--points", type=int, default=4, help="goodput sweep: rates tried per deployment")
    p.add_argument(
        "--start-rate", type=float, help="goodput sweep: first rate (default: from the unloaded latency)"
    )
    p.add_argument(
        "--transfer-gbps", type=float, default=3.0, help="KV transfer bandwidth the planner assumes"
    )
    p.add_argument("--no-prediction", action="store_true", help="skip the planner's prediction")
    p.add_argument("--layouts", default="colocated,disaggregated,overflow",
                   help=f"goodput sweep: layouts to compare with colocated ({', '.join(LAYOUTS)})")  # fmt: skip
    p.add_argument("--overflow-margin", type=float, default=LAYOUTS["overflow"][3],
                   help="the overflow layout's router --prefill-overflow margin (requests)")  # fmt: skip
    p.add_argument("--aiperf", metavar="PATH",
                   help="the aiperf executable: also drive every rate with it (goodput constraints at the base "
                        "SLO scale) and print its goodput beside ours")  # fmt: skip
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the two runs with the long prompts cached beforehand (no prefill interference)")  # fmt: skip
    args = p.parse_args(argv)
    if args.model is None:
        args.model = str(ensure_model(Path(".models") / args.preset, args.preset))
    if not args.interference:
        return goodput_main(args)
    if args.disagg_threshold is None:
        args.disagg_threshold = 256
    plan = workload(args)
    print(f"model {args.model} ({args.preset if args.model.endswith(args.preset) else 'custom'}); "
          f"{len(plan)} requests: {sum(k == 'long-prompt' for _t, k, _p, _n in plan)} long-prompt "
          f"(~{args.long_prompt} tok in, {args.short_output} out), the rest long-output "
          f"(~{args.short_prompt} in, {args.long_output} out)", flush=True)  # fmt: skip
    colocated = run_one(args, "colocated", 0, 0, 2, plan)
    disagg = run_one(args, "disaggregated", 1, 1, 0, plan)
    print(f"\n{'metric':<28}{'(a) 2x both':>14}{'(b) 1P+1D':>14}{'b/a':>8}")
    for key in colocated:
        a, b = colocated[key], disagg[key]
        print(f"{key:<28}{a:>14.2f}{b:>14.2f}{_ratio(b, a):>8.2f}")
    if not args.no_baseline:
        # The same requests at the same instants, with every long prompt already in the prefix
        # cache: the decode work is unchanged (same contexts), only the prefill compute is gone.
        # The ratio is how much of each layout's decode latency is prefill interference.
        key = "ITL p99 long-output (ms)"
        a0 = run_one(args, "colocated-prefilled-ahead", 0, 0, 2, plan, precache=True)[key]
        b0 = run_one(args, "disaggregated-prefilled-ahead", 1, 1, 0, plan, precache=True)[key]
        print(f"\n{key:<28}{'(a) 2x both':>14}{'(b) 1P+1D':>14}")
        print(f"{'prefill interference':<28}{colocated[key]:>14.2f}{disagg[key]:>14.2f}")
        print(f"{'prompts cached (none)':<28}{a0:>14.2f}{b0:>14.2f}")
        print(
            f"{'interference ratio':<28}{_ratio(colocated[key], a0):>14.2f}{_ratio(disagg[key], b0):>14.2f}"
        )
    print(f"\ngoodput: TTFT <= {args.ttft_slo * 1e3:.0f} ms and mean ITL <= {args.itl_slo * 1e3:.0f} ms; "
          f"workers pinned one per core, torch threads 1, KV transfer {args.kv_transfer}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
