"""Step 7: the KV tiers on the GPU: blocks evicted from VRAM to page-locked host memory and on to
disk come back bit for bit, and how fast blocks move between VRAM and the host tier.

A prompt is served, its blocks evicted by other prompts (the host tier small enough that some go
on to disk), and served again: its tokens and logprobs must equal a warm prefix-cache hit's on an
engine whose cache kept the prompt, and its blocks must come from the tiers. Figures: the copy
rates of one batch of blocks VRAM -> host tier (asynchronous, then synchronised) and back.
"""

from __future__ import annotations

import tempfile
import time

import models
import torch
from common import Context, StepResult

BS = 16


def _run(engine, prompt, rid):
    from disagg.worker import SamplingParams

    engine.add_request(
        rid, prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    )
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                last = out
    c = last.outputs[0]
    return last.num_cached_tokens, c.token_ids, [(lp.token_id, lp.logprob) for lp in c.logprobs]


def round_trip(ctx: Context, r: StepResult, work) -> None:
    from disagg.worker.engine.llm_engine import LLMEngine

    path = str(models.ensure("tiny-trained", ctx.work))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(10, 1000, (8 * BS,), generator=g).tolist()
    fillers = [torch.randint(10, 1000, (8 * BS,), generator=g).tolist() for _ in range(3)]
    common = dict(block_size=BS, dtype="float32", device=ctx.device, load_tokenizer=False)
    warm = LLMEngine(path, num_gpu_blocks=64, **common)
    _run(warm, prompt, "cold")
    hit = _run(warm, prompt, "warm")
    block_bytes = warm.model.kv_cache_block_bytes(BS)
    engine = LLMEngine(path, num_gpu_blocks=12, kv_host_cache_memory=4 * block_bytes,
                       kv_disk_cache_dir=f"{work}/kv", kv_disk_cache_size=1 << 30, **common)  # fmt: skip
    try:
        _run(engine, prompt, "first")
        for i, f in enumerate(fillers):
            _run(engine, f, f"filler-{i}")
        engine.tiers.disk.flush()
        again = _run(engine, prompt, "again")
        snap = engine.tiers.snapshot()
        r.check("a prompt evicted to host and disk comes back = a warm cache hit", again == hit,
                f"cached {again[0]} tokens; host hits {snap['host']['hits']}, disk hits {snap['disk']['hits']}")  # fmt: skip
        r.check("its blocks came from the tiers", snap["host"]["hits"] + snap["disk"]["hits"] == 7)
    finally:
        engine.close()


def copy_rates(ctx: Context, r: StepResult) -> None:
    from disagg.worker.engine.tiers.tiers import KVTiers

    blocks = 256 if ctx.full else 8
    # Llama-3-8B's block: 32 layers x K/V x 16 tokens x 8 KV heads x 128 x bf16 = 2 MiB
    shape = (32, blocks + 8, 2, BS, 8, 128) if ctx.full else (2, blocks + 8, 2, BS, 2, 16)
    cache = torch.randn(shape, dtype=torch.bfloat16, device=ctx.device)
    tiers = KVTiers(cache, BS, host_bytes=blocks * cache[:, 0].numel() * 2)
    ids = list(range(blocks))
    hashes, token_ids = [1000 + b for b in ids], list(range(blocks * BS))
    evicted = [(b, hashes[b], tuple(token_ids[b * BS : (b + 1) * BS])) for b in ids]
    ctx.synchronize()
    t = time.perf_counter()
    tiers.offload(evicted)
    ctx.synchronize()
    down = time.perf_counter() - t
    before = cache[:, :blocks].clone()
    cache[:, :blocks].zero_()
    hit = tiers.find(hashes, token_ids, 0, blocks)  # the host slots, pinned
    ctx.synchronize()
    t = time.perf_counter()
    restored = tiers.restore(hit, ids)
    ctx.synchronize()
    up = time.perf_counter() - t
    r.check("host tier round trip is exact", restored == blocks and torch.equal(cache[:, :blocks], before))
    nbytes = blocks * tiers.block_bytes
    r.figure(
        "VRAM -> host tier", nbytes / down / 1e9, "GB/s", f"{blocks} blocks of {tiers.block_bytes >> 10} KiB"
    )
    r.figure(
        "host tier -> VRAM", nbytes / up / 1e9, "GB/s", f"{blocks} blocks of {tiers.block_bytes >> 10} KiB"
    )


def run(ctx: Context) -> StepResult:
    r = StepResult()
    with tempfile.TemporaryDirectory(prefix="gpu-kv-tiers-") as work:
        round_trip(ctx, r, work)
    copy_rates(ctx, r)
    return r
