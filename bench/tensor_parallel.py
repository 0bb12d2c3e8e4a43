"""`bench/engine.py --tensor-parallel-size N`: the same model at TP=1 and TP=N on the same cores.

TP=1 runs with every core as torch threads; TP=N runs N ranks with an equal share each. Measured
per degree: the median batch-1 and batch-8 decode step, prefill throughput (prompt tokens/s of
a few long prompts), and the time rank 0 spends inside the step's collectives (all-reduce after
the o and down projections and the embedding, all-gather of the logits; the time includes waiting
for the slowest rank, which is what a step pays).
"""

from __future__ import annotations

import os
import time
from pathlib import Path


class CollectiveTimer:
    """Wraps rank 0's collectives and adds up the seconds spent in them."""

    def __init__(self, tp):
        self.seconds = 0.0
        self.calls = 0
        for name in ("all_reduce", "all_gather"):
            setattr(tp, name, self._timed(getattr(tp, name)))

    def _timed(self, fn):
        def timed(x):
            t = time.perf_counter()
            out = fn(x)
            self.seconds += time.perf_counter() - t
            self.calls += 1
            return out

        return timed

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


def _decode_steps(engine, batch: int, steps: int, timer) -> tuple[float, float]:
    """Median decode step of `batch` sequences and the median share of it in collectives."""
    from disagg.worker import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", list(range(10 + i, 138 + i)), params)
    times, shares = [], []
    while engine.has_unfinished():
        if timer is not None:
            timer.take()
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if not engine.scheduled.is_prefill:
            times.append(dt)
            shares.append(timer.take()[0] / dt if timer is not None else 0.0)
    times.sort()
    shares.sort()
    return times[len(times) // 2], shares[len(shares) // 2]


def _prefill(engine, prompts: int, length: int, timer) -> tuple[float, float]:
    """Prompt tokens per second of `prompts` prompts of `length` tokens (one output token each),
    and the share of that time in collectives."""
    from disagg.worker import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    for i in range(prompts):
        engine.add_request(f"p{i}", [10 + (i * 7 + j) % 20000 for j in range(length)], params)
    if timer is not None:
        timer.take()
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    dt = time.perf_counter() - t
    return prompts * length / dt, (timer.take()[0] / dt if timer is not None else 0.0)


def measure(model_dir: Path, tp: int, threads: int, log) -> dict:
    from disagg.worker.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        str(model_dir), load_tokenizer=False, dtype="float32", device="cpu", tensor_parallel_size=tp,
        threads=threads, num_gpu_blocks=512, max_num_batched_tokens=512, enable_prefix_caching=False,
    )  # fmt: skip
    try:
        timer = CollectiveTimer(engine.model.tp) if engine.model.tp is not None else None
        _decode_steps(engine, 1, 4, timer)  # warm-up
        out = {}
        log(f"TP={tp}, {threads} thread(s) per rank: decode at batch 1 and 8, prefill")
        out["decode1"], out["decode1_coll"] = _decode_steps(engine, 1, 32, timer)
        out["decode8"], out["decode8_coll"] = _decode_steps(engine, 8, 16, timer)
        out["prefill"], out["prefill_coll"] = _prefill(engine, 4, 512, timer)
        out["load"] = os.getloadavg()[0]
        return out
    finally:
        engine.close()


ROWS = [
    ("decode step, batch 1", "decode1", "ms", 1e3),
    ("decode step, batch 8", "decode8", "ms", 1e3),
    ("prefill, 4 x 512 tokens", "prefill", "tok/s", 1.0),
]


def report(model_dir: Path, tp: int, log) -> None:
    cores = len(os.sched_getaffinity(0))
    share = max(1, cores // tp)
    load_start = os.getloadavg()[0]
    runs = [("TP=1", measure(model_dir, 1, cores, log)), (f"TP={tp}", measure(model_dir, tp, share, log))]
    if share != cores:
        # TP=1 on one rank's share of the cores tells TP's own effect apart from that of fewer
        # threads per process (on a loaded machine, threads waiting on each other cost the most)
        runs.append((f"TP=1/{share}t", measure(model_dir, 1, share, log)))
    print(
        f"\ntensor parallelism on {cores} CPU cores (TP=1: {cores} threads; TP={tp}: {share} per rank; "
        f"TP=1/{share}t: TP=1 on {share} thread(s)), float32, gloo; 1-min load {load_start:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end"
    )
    base, tp_run = runs[0][1], runs[1][1]
    print(f"  {'':<24}" + "".join(f"{name:>14}" for name, _ in runs) + f"{'TP=' + str(tp) + ' / TP=1':>14}"
          f"  rank 0 in collectives at TP={tp}")  # fmt: skip
    for name, key, unit, scale in ROWS:
        cells = "".join(f"{r[key] * scale:>8.2f} {unit:<5}" for _, r in runs)
        ratio = tp_run[key] / base[key]
        print(f"  {name:<24}{cells}{ratio:>13.2f}x  {tp_run[key + '_coll']:.0%} of the time")
    print("  load after each run: " + ", ".join(f"{name} {r['load']:.2f}" for name, r in runs))
