"""Serving benchmark: colocated workers vs 1 prefill + 1 decode, same cores, same model, same load.

An open-loop Poisson load (arrivals do not wait for answers) mixes long prompts with short
outputs (prefill-heavy) and short prompts with long outputs (decode-heavy). Each deployment runs
under `disagg up`'s process layout with every worker pinned to its own core and one torch
thread, so (a) 2 x `--role both` and (b) 1 prefill + 1 decode use the same hardware. Prints TTFT
and ITL percentiles, throughput and goodput (requests meeting both the TTFT and the ITL target)
side by side, with the ratio disaggregated / colocated.

    python bench/serve.py                     # tiny model, defaults
    python bench/serve.py --preset small --rate 0.5 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from disagg.worker.cli.ports import free_port
from disagg.worker.cli.up import Deployment


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


def deploy(args, name: str, prefill: int, decode: int, both: int) -> Deployment:
    ns = argparse.Namespace(
        model=args.model, prefill=prefill, decode=decode, both=both, port=free_port(),
        kv_transfer=args.kv_transfer, disagg_threshold=args.disagg_threshold, threads=1,
        run_dir=str(Path(args.run_dir) / name), demo=False, timeout=600.0, worker_arg=[],
        max_num_batched_tokens=args.max_num_batched_tokens,  # engine settings absent here take EngineArgs' defaults
    )  # fmt: skip
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
    p.add_argument("--disagg-threshold", type=int, default=256)
    p.add_argument("--kv-transfer", choices=("nixl", "grpc"), default="nixl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default=".run/bench")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the two runs with the long prompts cached beforehand (no prefill interference)")  # fmt: skip
    args = p.parse_args(argv)
    if args.model is None:
        path = Path(".models") / args.preset
        if not (path / "config.json").is_file():
            from disagg.worker.tools.make_model import make_model

            print(f"making the {args.preset} model under {path} ...", flush=True)
            make_model(path, preset=args.preset)
        args.model = str(path)
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
