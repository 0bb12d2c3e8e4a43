"""A worker's warm-up before it reports ready (runs on the engine-loop thread)."""

from __future__ import annotations

import time

import torch

from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.serving.prefill_estimate import PrefillRate


def warm_up(engine, block_size: int, rate: PrefillRate, max_tokens: int = 256, passes: int = 3) -> None:
    """Prefill a random prompt a few times before serving: the first pass pays the one-off
    costs (kernel builds, allocator growth, cold caches) that a user's first request would pay,
    the fastest later pass seeds this worker's prefill `rate` (the fastest: other processes
    starting beside this one only ever slow a pass down), so load-aware placement can price
    prefills from the first request on. Leaves the engine as it found it (no request, stats
    reset, nothing cached: its random prompts would only take room from users' prefixes)."""
    e = engine
    sched = e.scheduler
    n = min(max_tokens, sched.max_num_batched_tokens, e.max_model_len - 1,
            (e.num_free_blocks - 1) * block_size)  # fmt: skip
    if n < rate.min_tokens:
        return
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, e.config.vocab_size, (n,), generator=g).tolist()
    stats = (sched.prefix_query_tokens, sched.prefix_hit_tokens, sched.num_preemptions)
    best = None
    for i in range(passes):
        # each pass must compute, not hit the prefix cache the one before filled
        prompt[0] = (prompt[0] + 1) % e.config.vocab_size
        e.add_request(f"warm-up-{i}", prompt, SamplingParams(max_tokens=1, temperature=0))
        started = time.monotonic()
        while e.has_unfinished():
            e.step()
        if i:
            best = min(best or float("inf"), time.monotonic() - started)
    sched.prefix_query_tokens, sched.prefix_hit_tokens, sched.num_preemptions = stats
    e.reset_prefix_cache()
    if best is not None:
        rate.observe(n, best, provisional=True)
