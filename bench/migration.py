"""What a client sees when its stream's decode worker dies or drains, and what a drain costs.

Kill: a deployment of 1 prefill + 2 decode workers (`disagg up`'s, every worker on its own core
where there are cores enough) serves `--streams` greedy streams; once each has sent a few chunks,
the decode worker serving the most is SIGKILLed. Its streams move to the other decode worker and
resume there. Printed: every stream's outcome, the pause the moved streams saw (their longest gap
between chunks) against the usual gap between chunks of the streams that did not move, p50/p99,
and the moved streams' tokens/s in the second before the gap and the second after it.

Drain: the same streams, and the busiest decode worker drained (`/drain`, what a pod's preStop
calls) with the hand-off off (the worker waits for its streams, up to --drain-timeout) and on
(`--drain-handoff`), the moved streams' K/V pulled from the draining worker (the default) or
prefilled again where the usual placement puts a prompt (`--handoff-pull-window 0`: the worker
they moved to, or the prefill worker): how long the drain took,
beside how long the streams still ran, and the pause the moved streams and the streams already
on the receiving worker saw (p50/p99 of each stream's longest gap after the drain began).

    python bench/migration.py --preset small
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from bench_model import ensure_model, log  # noqa: E402
from machine import cpu_name  # noqa: E402

from disagg.worker.cli.flags import Up  # noqa: E402
from disagg.worker.cli.ports import free_port  # noqa: E402
from disagg.worker.cli.up import Deployment, add_arguments  # noqa: E402
from disagg.worker.engine.args import EngineArgs  # noqa: E402
from disagg.worker.serving.args import ServingArgs  # noqa: E402


@dataclass
class Stream:
    decode: str = ""
    arrivals: list[float] = field(default_factory=list)  # when each chunk with text arrived
    done: bool = False
    error: str | None = None


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def deploy(
    args, name: str, handoff: float, pull_window: float = ServingArgs.handoff_pull_window
) -> Deployment:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args([
        Up.MODEL, str(args.model), Up.PREFILL, "1", Up.DECODE, "2", Up.PORT, str(free_port()),
        *EngineArgs.cli_args(threads=1), Up.RUN_DIR, str(Path(args.run_dir) / name), Up.TIMEOUT, "600",
        *ServingArgs.cli_args(drain_timeout=args.drain_timeout, drain_handoff=handoff, handoff_pull_window=pull_window),
    ])  # fmt: skip
    dep = Deployment(ns)
    dep.plan()
    cores = os.cpu_count() or 1
    if shutil.which("taskset") and cores >= 3:
        workers = [c for c in dep.children if c.name not in ("redis", "router")]
        for i, c in enumerate(workers):
            c.cmd = ["taskset", "-c", str(i % cores), *c.cmd]
    return dep


async def stream(session, url: str, model: str, i: int, max_tokens: int, out: Stream) -> None:
    body = {"model": model, "prompt": f"Stream {i}: tell a long story about the number {i}.",
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            out.decode = r.headers.get("X-Disagg-Decode-Worker", "")
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = str(event["error"])[:200]
                elif any(ch.get("text") for ch in event.get("choices", [])):
                    out.arrivals.append(time.monotonic())
    except aiohttp.ClientError as e:
        out.error = repr(e)


def busiest(streams: list[Stream]) -> str:
    names = [s.decode for s in streams if s.decode]
    return max(set(names), key=names.count)


async def run_streams(dep: Deployment, args, fault) -> tuple[list[Stream], float, float]:
    """The streams, `fault(victim)` once each sent a few chunks; (streams, when hit, when all ended)."""
    streams = [Stream() for _ in range(args.streams)]
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [
            asyncio.create_task(stream(session, dep.router_url, dep.model.name, i, args.max_tokens, s))
            for i, s in enumerate(streams)
        ]
        while not all(len(s.arrivals) >= 5 or s.error for s in streams):
            await asyncio.sleep(0.01)
        hit = time.monotonic()
        await fault(busiest(streams))
        await asyncio.gather(*tasks)
    return streams, hit, time.monotonic()


def gaps(s: Stream) -> list[float]:
    return [b - a for a, b in zip(s.arrivals, s.arrivals[1:], strict=False)]


def rate_around(s: Stream, at: float, window: float = 1.0) -> tuple[float, float]:
    before = sum(1 for t in s.arrivals if at - window <= t < at) / window
    after = sum(1 for t in s.arrivals if at < t <= at + window) / window
    return before, after


def kill_phase(args) -> None:
    dep = deploy(args, "kill", handoff=2.0)
    try:
        log("kill: starting 1 prefill + 2 decode workers ...")
        dep.start()
        victims: list[str] = []

        async def kill(victim: str) -> None:
            child = next(c for c in dep.children if c.name == victim)
            child.proc.send_signal(signal.SIGKILL)
            victims.append(victim)

        streams, hit, end = asyncio.run(run_streams(dep, args, kill))
    finally:
        dep.stop()
    moved = [s for s in streams if s.decode == victims[0]]
    stayed = [s for s in streams if s.decode != victims[0]]
    usual = [g for s in stayed for g in gaps(s)]
    pauses = [max(gaps(s), default=float("nan")) for s in moved]
    ok = sum(1 for s in streams if s.done and not s.error)
    print(f"\nkill: {len(streams)} streams, {len(moved)} on the killed worker {victims[0]}; "
          f"{ok}/{len(streams)} completed, {sum(1 for s in streams if s.error)} errors")  # fmt: skip
    print(f"  usual gap between chunks (streams that stayed): p50 {pct(usual, 50) * 1e3:7.1f} ms  "
          f"p99 {pct(usual, 99) * 1e3:7.1f} ms")  # fmt: skip
    print(f"  pause of moved streams (longest gap):        p50 {pct(pauses, 50) * 1e3:7.1f} ms  "
          f"p99 {pct(pauses, 99) * 1e3:7.1f} ms  ({pct(pauses, 50) / pct(usual, 50):.0f}x the usual p50)")  # fmt: skip
    rates = []
    for s in moved:
        g = gaps(s)
        i = max(range(len(g)), key=g.__getitem__)
        rates.append((rate_around(s, s.arrivals[i])[0], rate_around(s, s.arrivals[i + 1])[1]))
    if rates:
        print(f"  moved streams' chunks/s: {statistics.mean(r[0] for r in rates):.1f} in the second before the "
              f"pause, {statistics.mean(r[1] for r in rates):.1f} in the second after it")  # fmt: skip


def pauses_after(streams: list[Stream], at: float) -> list[float]:
    """Each stream's longest gap between chunks from `at` on (streams that ended before: none)."""
    out = []
    for s in streams:
        later = [t for t in s.arrivals if t >= at]
        if len(later) >= 2:
            out.append(max(b - a for a, b in zip(later, later[1:], strict=False)))
    return out


def drain_phase(
    args, handoff: float, label: str, pull_window: float = ServingArgs.handoff_pull_window
) -> tuple[float, float]:
    dep = deploy(args, f"drain-{label}", handoff=handoff, pull_window=pull_window)
    took: dict = {}
    try:
        log(f"drain ({label}): starting 1 prefill + 2 decode workers ...")
        dep.start()

        async def drain(victim: str) -> None:
            took["victim"] = victim
            child = next(c for c in dep.children if c.name == victim)
            url = child.health_url.replace("/health", "/drain")
            request = urllib.request.Request(url, headers={"Authorization": f"Bearer {dep.internal_token}"})

            def call():
                start = time.monotonic()
                with urllib.request.urlopen(request, timeout=args.drain_timeout + 30) as r:
                    took["body"] = r.read().decode()
                took["seconds"] = time.monotonic() - start

            took["task"] = asyncio.get_running_loop().run_in_executor(None, call)

        streams, hit, end = asyncio.run(run_streams(dep, args, drain))
    finally:
        dep.stop()
    errors = sum(1 for s in streams if s.error or not s.done)
    print(f"  drain {label:>16}: {took.get('seconds', float('nan')):6.2f} s to drain; the streams ran on "
          f"{end - hit:6.2f} s; {errors} streams failed; {took.get('body', '')}")  # fmt: skip
    victim = took.get("victim", "")
    moved = pauses_after([s for s in streams if s.decode == victim], hit)
    stayed = pauses_after([s for s in streams if s.decode != victim], hit)
    print(f"  {'':>22}longest gap after the drain began: moved streams p50 {pct(moved, 50) * 1e3:7.1f} ms "
          f"p99 {pct(moved, 99) * 1e3:7.1f} ms; streams on the receiving workers p50 "
          f"{pct(stayed, 50) * 1e3:7.1f} ms p99 {pct(stayed, 99) * 1e3:7.1f} ms")  # fmt: skip
    return took.get("seconds", float("nan")), pct(moved, 50)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: .models/<preset>, made if missing)")
    p.add_argument("--preset", choices=("tiny", "small"), default="small")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--drain-timeout", type=float, default=120.0)
    p.add_argument("--drain-handoff", type=float, default=ServingArgs.drain_handoff)
    p.add_argument("--run-dir", default="/tmp/disagg-bench-migration")
    args = p.parse_args(argv)
    if args.model is None:
        args.model = str(ensure_model(Path(".models") / args.preset, args.preset))
    print(f"model {args.model}; {args.streams} greedy streams of {args.max_tokens} tokens; "
          f"{os.cpu_count()} cores ({cpu_name()}), load {os.getloadavg()[0]:.1f}")  # fmt: skip
    kill_phase(args)
    print("\ndrain of the busiest decode worker:")
    waited, _ = drain_phase(args, args.drain_timeout, "waiting")
    handed, pulled_pause = drain_phase(args, args.drain_handoff, "handoff, pull")
    _, replayed_pause = drain_phase(args, args.drain_handoff, "handoff, prefill", pull_window=0.0)
    print(f"  the hand-off drains in {handed / waited:.2f}x the time of waiting for the streams; the moved "
          f"streams' p50 pause with their K/V pulled is {pulled_pause / replayed_pause:.2f}x that with it "
          "prefilled again")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
