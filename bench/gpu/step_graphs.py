"""Step 2: decode CUDA graphs captured for every batch bucket of the engine's default
`max_num_seqs`, each replayed on a real decode step and compared with the eager forward: the same
padded batch must give bit-identical logits, the unpadded one the same greedy tokens."""

from __future__ import annotations

import sys

import models
import torch
from common import ROOT, Context, StepResult, rel_error

sys.path.insert(0, str(ROOT / "tests"))
from worker.conftest import PagedSequences  # noqa: E402


def run(ctx: Context) -> StepResult:
    from disagg.worker.engine.args import EngineArgs
    from disagg.worker.model.cuda_graphs import CudaGraphRunner, batch_size_buckets
    from disagg.worker.model.loader import load_model

    r = StepResult()
    if not ctx.device.startswith("cuda"):
        r.note("CUDA graphs need a GPU: capture not tried")
        return r
    max_seqs = EngineArgs().max_num_seqs
    buckets = batch_size_buckets(max_seqs)
    model, _ = load_model(models.ensure("small", ctx.work), dtype="bfloat16", device=ctx.device)
    block = 16
    prompt_len = 40
    num_blocks = max_seqs * (-(-(prompt_len + 2) // block)) + 1
    kv = model.allocate_kv_cache(num_blocks, block)
    runner = CudaGraphRunner(model.forward, kv, max_batch=max_seqs, max_blocks_per_seq=8, device=ctx.device,
                             scratch_block=num_blocks - 1)  # fmt: skip
    import time

    t = time.perf_counter()
    runner.capture()
    r.figure(
        "capture of every bucket", time.perf_counter() - t, "s", f"{len(buckets)} buckets up to {max_seqs}"
    )
    r.check("every bucket captured", runner.enabled and runner.captured_buckets == buckets,
            f"{len(runner.captured_buckets)} of {len(buckets)}")  # fmt: skip
    if not runner.enabled:
        return r
    g = torch.Generator().manual_seed(0)
    seqs = PagedSequences(block)
    prompts = [torch.randint(10, 32000, (prompt_len,), generator=g).tolist() for _ in range(max_seqs)]
    for i in range(0, max_seqs, 32):  # prefill eagerly, 32 sequences a step
        model.forward(
            seqs.prefill([(s, prompts[s]) for s in range(i, min(i + 32, max_seqs))]).to(ctx.device), kv
        )
    worst, mismatched, inexact = 0.0, [], []
    for bucket in buckets:
        n = max(1, bucket - 1) if bucket > 2 else bucket  # below the bucket: padding rows too
        step = seqs.decode([(s, 11 + s) for s in range(n)]).to(ctx.device)
        eager_kv, graph_kv = kv.clone(), kv
        eager = model.forward(step, eager_kv)
        padded = runner.buffers.load(step, bucket)
        eager_padded = model.forward(padded, kv.clone())[:n]
        replay = runner.run(step)
        if not torch.equal(replay, eager_padded):
            inexact.append(bucket)
        if not torch.equal(replay.argmax(-1), eager.argmax(-1)):
            mismatched.append(bucket)
        worst = max(worst, rel_error(replay, eager))
        # the step's KV went into the cache the same way: graph and eager leave equal caches
        if not torch.equal(graph_kv[:, : num_blocks - 1], eager_kv[:, : num_blocks - 1]):
            inexact.append(f"{bucket}:kv")
        for s in range(n):  # undo this step's tokens so every bucket starts from the prompts
            seqs.lens[s] -= 1
    r.check(
        "replay = eager forward on the same padded batch, bit for bit",
        not inexact,
        f"differs at {inexact}" if inexact else f"{len(buckets)} buckets",
    )
    r.check(
        "replay greedy tokens = unpadded eager",
        not mismatched,
        f"differs at buckets {mismatched}" if mismatched else "",
    )
    r.figure("worst replay vs unpadded eager logits", worst, "rel err")
    for n in (1, 64):
        step = seqs.decode([(s, 11 + s) for s in range(n)]).to(ctx.device)
        from common import time_ms

        g_ms = time_ms(lambda step=step: runner.run(step), ctx)
        e_ms = time_ms(lambda step=step: model.forward(step, kv), ctx)
        for s in range(n):
            seqs.lens[s] -= 1
        r.figure(
            f"small bf16 decode step B={n}: graph",
            g_ms * 1e3,
            "us",
            f"eager {e_ms * 1e3:.0f} us, {e_ms / g_ms:.1f}x",
        )
    return r
