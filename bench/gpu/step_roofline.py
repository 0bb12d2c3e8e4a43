"""Step 4: the engine's decode step and prefill against the device's own ceilings.

On the four-layer Llama-3-8B-shaped checkpoint in bf16 (2.3 GB of weights a step), through the
engine (`engine.step()`, scheduling and sampling included, CUDA graphs as served): the decode step
at batch 1 and 64 against the HBM floor (weight bytes ÷ the measured device-to-device copy
bandwidth), and one 2048-token prefill step against the bf16 matrix-product rate measured in the
same run.
"""

from __future__ import annotations

import sys
import time

import models
import torch
from common import ROOT, Context, StepResult, measure_ceilings

sys.path.insert(0, str(ROOT / "bench"))


def prefill_flops(cfg, tokens: int) -> float:
    """Matmul FLOPs of one prefill of `tokens` (causal attention counted once per pair)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    per_token = 2 * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i)
    attention = 2 * 2 * hq * d * tokens * (tokens + 1) / 2
    return cfg.num_hidden_layers * (per_token * tokens + attention) + 2 * h * cfg.vocab_size


def run(ctx: Context) -> StepResult:
    import engine as bench_engine

    from disagg.worker import LLM, SamplingParams
    from disagg.worker.model.config import ModelConfig

    r = StepResult()
    ceil = measure_ceilings(ctx)
    r.figure(
        "device-to-device copy", ceil["copy_bytes_per_s"] / 1e12, "TB/s", "bytes read + written, random data"
    )
    r.figure("matrix product", ceil["matmul_flops"] / 1e12, "TFLOP/s", f"{ceil['matmul_dtype']}, random data")
    path = models.ensure("llama3-8b-4l" if ctx.full else "tiny-trained", ctx.work)
    dtype = "bfloat16" if ctx.full else "float32"
    llm = LLM(str(path), dtype=dtype, device=ctx.device, max_num_seqs=64, max_num_batched_tokens=2048)
    weights = bench_engine.weight_bytes_per_decode_step(llm.engine.model)
    floor = weights / ceil["copy_bytes_per_s"]
    r.figure("weights read per decode step", weights / 2**30, "GiB", f"{path.name} {dtype}")
    for batch in (1, 64) if ctx.full else (1, 4):
        ((step_s, best_s, _, _),) = bench_engine.decode_step_times(
            llm, steps=48 if ctx.full else 4, batch=batch
        )
        r.figure(f"decode step B={batch}", step_s * 1e3, "ms", f"best {best_s * 1e3:.3f} ms")
        r.figure(f"decode step B={batch} / HBM floor", step_s / floor, "x", f"floor {floor * 1e3:.3f} ms")
        # faster than reading the weights once can only be a timing that missed the device's work
        r.check(f"decode step B={batch} no faster than its HBM floor", best_s >= floor,
                f"best {best_s * 1e3:.3f} ms, floor {floor * 1e3:.3f} ms")  # fmt: skip
    engine = llm.engine
    cfg = ModelConfig.from_pretrained(path)
    tokens = 2048 if ctx.full else 64
    g = torch.Generator().manual_seed(1)
    times = []
    for k in range(4):
        prompt = torch.randint(10, cfg.vocab_size, (tokens,), generator=g).tolist()
        engine.add_request(f"prefill-{k}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
        ctx.synchronize()
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        ctx.synchronize()
        times.append(time.perf_counter() - t)
    prefill_s = sorted(times[1:])[len(times[1:]) // 2]  # the first compiles kernels
    flops = prefill_flops(cfg, tokens)
    r.figure(f"prefill {tokens} tokens", prefill_s * 1e3, "ms", f"{tokens / prefill_s:.0f} tok/s")
    r.figure(f"prefill {tokens} tokens / matmul peak", flops / prefill_s / ceil["matmul_flops"], "of peak",
             f"{flops / prefill_s / 1e12:.1f} TFLOP/s achieved")  # fmt: skip
    r.check(f"prefill {tokens} tokens no faster than the matmul peak", flops / prefill_s <= ceil["matmul_flops"],
            f"{flops / prefill_s / 1e12:.1f} of {ceil['matmul_flops'] / 1e12:.1f} TFLOP/s")  # fmt: skip
    return r
