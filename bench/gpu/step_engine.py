"""Step 3: the engine on the GPU against transformers on the same GPU.

Greedy: `tiny-trained` in bf16, corpus-style prompts it never saw whole, 32 new tokens each: the
engine's tokens must equal transformers' `generate`. Throughput: `bench/engine.py`'s ragged
workload on the `small` preset in bf16 (all prompts at once for the engine; transformers in
length-sorted batches, its best fair setting), output tokens per second and their ratio.
"""

from __future__ import annotations

import argparse
import sys

import models
import torch
from common import ROOT, Context, StepResult

sys.path.insert(0, str(ROOT / "bench"))

# sentence openings in the style of the trained presets' corpus, none a whole corpus line
PROMPTS = [
    "The engineer",
    "A curious child",
    "The old lighthouse keeper reads",
    "Every worker in the quiet village",
    "The storm predicts",
    "My neighbour paints a long letter and",
    "The orchestra answers the committee because",
    "A hungry fox follows",
    "The database remembers",
    "Our cluster schedules the morning news while",
]


def greedy_matches(ctx: Context, r: StepResult) -> None:
    from transformers import AutoModelForCausalLM

    from disagg.worker import LLM, SamplingParams

    path = models.ensure("tiny-trained", ctx.work)
    dtype = "bfloat16" if ctx.full else "float32"
    llm = LLM(str(path), dtype=dtype, device=ctx.device)
    tok = llm.get_tokenizer()
    new = 32
    ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval().to(ctx.device)
    same, first_diff = 0, []
    for prompt, ids_p, out in zip(PROMPTS, ids, outs, strict=True):
        with torch.no_grad():
            # an explicit mask: the pad id is the BOS id here, which generate would otherwise mask
            x = torch.tensor([ids_p], device=ctx.device)
            ref = hf.generate(
                input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new,
                min_new_tokens=new, pad_token_id=0,
            )[0, len(ids_p):].tolist()  # fmt: skip
        got = list(out.outputs[0].token_ids)
        if got == ref:
            same += 1
        else:
            at = (
                next(i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b)
                if got[: len(ref)] != ref[: len(got)]
                else min(len(got), len(ref))
            )
            first_diff.append(f"{prompt!r} at token {at}")
    r.check(f"greedy = transformers, {dtype}, {len(PROMPTS)} prompts x {new} tokens", same == len(PROMPTS),
            f"{same}/{len(PROMPTS)} identical" + (f"; first differences: {'; '.join(first_diff[:3])}" if first_diff else ""))  # fmt: skip
    r.figure("greedy prompts identical to transformers", same, f"of {len(PROMPTS)}")
    del llm, hf


def throughput(ctx: Context, r: StepResult) -> None:
    import engine as bench_engine

    from disagg.worker.model.config import ModelConfig

    path = models.ensure("small" if ctx.full else "tiny-trained", ctx.work)
    args = argparse.Namespace(
        num_prompts=64 if ctx.full else 4, min_prompt=32, max_prompt=512 if ctx.full else 48, min_output=16,
        max_output=256 if ctx.full else 20, seed=0, hf_batch_size=16, max_num_seqs=64, max_num_batched_tokens=2048,
    )  # fmt: skip
    work = bench_engine.workload(args, ModelConfig.from_pretrained(path).vocab_size)
    dtype = "bfloat16" if ctx.full else "float32"
    eng_s, eng_tok, llm = bench_engine.run_engine(args, path, work, dtype=dtype)
    r.check("engine ran on the GPU" if ctx.full else "engine ran", str(llm.engine.model.device).startswith(ctx.device.split(":")[0]),
            str(llm.engine.model.device))  # fmt: skip
    del llm
    torch.cuda.empty_cache() if ctx.device.startswith("cuda") else None
    hf_s, hf_tok = bench_engine.run_transformers(
        args, path, work, dtype=getattr(torch, dtype), device=ctx.device
    )
    what = f"{len(work)} prompts {args.min_prompt}-{args.max_prompt} tokens, {args.min_output}-{args.max_output} new"
    r.figure("engine output tokens/s", eng_tok / eng_s, "tok/s", f"{what}, {path.name} {dtype}")
    r.figure(
        "transformers output tokens/s",
        hf_tok / hf_s,
        "tok/s",
        f"batches of {args.hf_batch_size}, sorted by length",
    )
    r.figure("engine / transformers", (eng_tok / eng_s) / (hf_tok / hf_s), "x")


def run(ctx: Context) -> StepResult:
    r = StepResult()
    greedy_matches(ctx, r)
    throughput(ctx, r)
    return r
