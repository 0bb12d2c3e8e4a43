"""Step 6: speculative decoding and the 8-bit KV cache on the GPU, checked as on the CPU.

Speculative decoding (n-gram and draft-model proposers) must leave greedy output unchanged, in
float32 where the target's verification pass and its plain decode compute the same function. An
int8 and an fp8 KV cache through the Triton kernels must give the tokens the torch twins give over
the same cache format; how often they agree with an unquantized cache is a figure.
"""

from __future__ import annotations

import os

import models
import torch
from common import Context, StepResult


def _greedy(llm, prompts, new: int) -> list[list[int]]:
    from disagg.worker import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def _prompts(vocab: int, full: bool) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    rand = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in ((12, 70, 300) if full else (12,))]
    loop = torch.randint(10, vocab, (9,), generator=g).tolist() * 6  # n-gram proposals get accepted
    return [*rand, loop]


def speculative(ctx: Context, r: StepResult) -> None:
    from disagg.worker import LLM

    target = str(models.ensure("tiny-trained", ctx.work))
    draft = str(models.ensure("tiny-trained-draft", ctx.work))
    prompts, new = _prompts(1024, ctx.full), 48 if ctx.full else 10
    plain = _greedy(LLM(target, dtype="float32", device=ctx.device), prompts, new)
    for method, extra in (("ngram", {}), ("draft", {"speculative_draft_model": draft})):
        llm = LLM(
            target,
            dtype="float32",
            device=ctx.device,
            speculative_method=method,
            num_speculative_tokens=4,
            **extra,
        )
        got = _greedy(llm, prompts, new)
        same = sum(a == b for a, b in zip(got, plain, strict=True))
        r.check(
            f"speculative {method}: greedy unchanged", same == len(prompts), f"{same}/{len(prompts)} prompts"
        )
        stats = getattr(llm.engine, "speculator", None)
        if stats is not None and hasattr(stats, "acceptance_rate"):
            r.figure(f"speculative {method} acceptance", float(stats.acceptance_rate), "of proposals")


def kv_quantized(ctx: Context, r: StepResult) -> None:
    from disagg.worker import LLM

    path = str(models.ensure("tiny-trained", ctx.work))
    prompts, new = _prompts(1024, ctx.full), 32 if ctx.full else 8
    dtype = "bfloat16" if ctx.full else "float32"
    exact = _greedy(LLM(path, dtype=dtype, device=ctx.device), prompts, new)
    for kv in ("int8", "fp8"):
        kernels = _greedy(LLM(path, dtype=dtype, device=ctx.device, kv_cache_dtype=kv), prompts, new)
        before = os.environ.get("DISAGG_KERNELS")
        os.environ["DISAGG_KERNELS"] = "torch"
        try:
            twins = _greedy(LLM(path, dtype=dtype, device=ctx.device, kv_cache_dtype=kv), prompts, new)
        finally:
            os.environ.pop("DISAGG_KERNELS") if before is None else os.environ.__setitem__(
                "DISAGG_KERNELS", before
            )
        same = sum(a == b for a, b in zip(kernels, twins, strict=True))
        r.check(
            f"{kv} KV cache: Triton kernels = torch twins, greedy",
            same == len(prompts),
            f"{same}/{len(prompts)} prompts",
        )
        agree = sum(x == y for a, b in zip(kernels, exact, strict=True) for x, y in zip(a, b, strict=True))
        r.figure(f"{kv} KV cache tokens = {dtype} cache", agree / (len(prompts) * new), "fraction of tokens")


def run(ctx: Context) -> StepResult:
    r = StepResult()
    speculative(ctx, r)
    kv_quantized(ctx, r)
    return r
