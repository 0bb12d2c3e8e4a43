"""Engine throughput against transformers, and batch-1 decode against the memory-bandwidth floor.

    python bench/engine.py                      # 64 prompts of 32-512 tokens, 16-256 new tokens each
    python bench/engine.py --num-prompts 16 --max-prompt 256 --max-output 64   # a quicker run
    python bench/engine.py --tensor-parallel-size 2   # TP=2 against TP=1 on the same cores only
    python bench/engine.py --quantization int8 --skip-transformers   # int8 weights against float32
    python bench/engine.py --kv-cache-dtype int8 --skip-transformers  # an int8 KV cache against float32

With `--dtype`, `--quantization` or `--kv-cache-dtype` other than float32 / none / auto, the
float32 engine (float32 KV cache) runs the same
workload and decode steps in the same command, and the ratios to it are printed (the machine is
shared: only figures of one run compare).

Both sides run the same checkpoint (the `small` preset, made into .models/small when missing),
float32, greedy, the same prompts and the same number of new tokens per prompt. transformers
runs `generate` in batches of prompts sorted by output length (least padding and least wasted
decoding: its best fair setting), left-padded, every row decoding until its batch's longest
output; only each prompt's own tokens are counted. The engine gets all prompts at once.

The batch-1 decode step is set against the time reading the weights once takes at the measured
memory bandwidth (`memory_floor.py`: copy, read-only and GEMV conventions, each with the load
average it was measured under); the ratio to the copy floor is the one judged.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from disagg.worker.engine.args import EngineArgs
from disagg.worker.model.precisions import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS

ROOT = Path(__file__).resolve().parent.parent

import memory_floor  # noqa: E402
from bench_model import ensure_model, log  # noqa: E402
from machine import cpu_name, kernel_report  # noqa: E402


def workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(args.seed)
    out = []
    for _ in range(args.num_prompts):
        n = int(torch.randint(args.min_prompt, args.max_prompt + 1, (1,), generator=g))
        m = int(torch.randint(args.min_output, args.max_output + 1, (1,), generator=g))
        # ids above the special tokens at the bottom of the vocabulary
        out.append((torch.randint(10, vocab_size, (n,), generator=g).tolist(), m))
    return out


def weight_bytes_per_decode_step(model) -> int:
    """Bytes of weights one decode step must read (`quantization.decode_weight_bytes`)."""
    from disagg.worker.model.quantization import decode_weight_bytes

    return decode_weight_bytes(model.weights)


def run_engine(
    args,
    model_dir: Path,
    work,
    dtype: str = "float32",
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
) -> tuple[float, int, object]:
    from disagg.worker import LLM, SamplingParams

    llm = LLM(
        model=str(model_dir),
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    prompts = [p for p, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=m, min_tokens=m) for _, m in work]
    llm.generate(prompts[:2], params[:2])  # warm-up
    log(f"engine: {len(prompts)} prompts")
    t = time.perf_counter()
    outs = llm.generate(prompts, params, progress=True)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(m for _, m in work)
    return elapsed, tokens, llm


def run_transformers(
    args, model_dir: Path, work, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().to(device)
    order = sorted(range(len(work)), key=lambda i: (work[i][1], len(work[i][0])))
    batches = [order[i : i + args.hf_batch_size] for i in range(0, len(order), args.hf_batch_size)]
    tokens = 0
    t = time.perf_counter()
    for k, batch in enumerate(batches):
        width = max(len(work[i][0]) for i in batch)
        new = max(work[i][1] for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            p = work[i][0]
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.no_grad():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
            )
        if device != "cpu":
            torch.cuda.synchronize()
        tokens += sum(work[i][1] for i in batch)
        rate = tokens / (time.perf_counter() - t)
        log(f"transformers: batch {k + 1}/{len(batches)} done, {tokens} tokens, {rate:.1f} tok/s")
    return time.perf_counter() - t, tokens


def decode_step_times(
    *llms, steps: int = 48, batch: int = 1, probe: memory_floor.CopyProbe | None = None
) -> list[tuple[float, float, float, float | None]]:
    """Per engine: median and shortest time of a step decoding `batch` sequences (prompts of 128
    tokens), the load average after them, and with `probe` the median over steps of step time ÷
    the copy floor of its weights sampled just before it (None without). Several engines take
    their steps in turn, so that a shared machine's changing load falls on all of them alike."""
    from disagg.worker import SamplingParams

    engines = [llm.engine for llm in llms]
    for engine in engines:
        for i in range(batch):
            engine.add_request(
                f"decode-bench-{i}",
                list(range(10 + i, 138 + i)),
                SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True),
            )
    times: list[list[float]] = [[] for _ in engines]
    ratios: list[list[float]] = [[] for _ in engines]
    weights = [weight_bytes_per_decode_step(e.model) for e in engines]
    while any(e.has_unfinished() for e in engines):
        floor = probe.seconds_per_byte() if probe else 0.0
        for engine, mine, ratio, w in zip(engines, times, ratios, weights, strict=True):
            if not engine.has_unfinished():
                continue
            t = time.perf_counter()
            engine.step()
            if not engine.scheduled.is_prefill and len(engine.scheduled.chunks) == batch:
                mine.append(time.perf_counter() - t)
                if probe:
                    ratio.append(mine[-1] / (w * floor))
    out = []
    for mine, ratio in zip(times, ratios, strict=True):
        if not mine:
            raise ValueError(f"no decode step ran {batch} sequences at once: is max_num_seqs below {batch}?")
        mine.sort()
        ratio.sort()
        out.append(
            (mine[len(mine) // 2], mine[0], os.getloadavg()[0], ratio[len(ratio) // 2] if ratio else None)
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", type=Path, default=ROOT / ".models" / "small", help="model dir (made if missing)"
    )
    ap.add_argument("--preset", default="small")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--decode-only", action="store_true", help="measure only the batch-1 decode step against the floor"
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's, one per core)"
    )
    ap.add_argument(
        "--tensor-parallel-size", type=int, default=EngineArgs.tensor_parallel_size,
        help="N > 1: only compare TP=N with TP=1 on the same cores (decode step, prefill, collectives)",
    )  # fmt: skip
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--quantization", default="none", choices=("none", *QUANTIZATIONS))
    ap.add_argument("--kv-cache-dtype", default=EngineArgs.kv_cache_dtype, choices=("auto", *KV_CACHE_DTYPES))
    ap.add_argument("--decode-batch", type=int, default=32, help="the larger decode batch measured")
    args = ap.parse_args(argv)
    if args.decode_batch > args.max_num_seqs:
        ap.error(f"--decode-batch {args.decode_batch} exceeds --max-num-seqs {args.max_num_seqs}")
    baseline = (args.dtype, args.quantization, args.kv_cache_dtype) != ("float32", "none", "auto")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]

    model_dir = ensure_model(args.model, args.preset)
    if args.tensor_parallel_size > 1:
        import tensor_parallel

        tensor_parallel.report(model_dir, args.tensor_parallel_size, log)
        return 0
    from disagg.kernels import cpu_bf16, cpu_native, native_build
    from disagg.worker.model.config import ModelConfig

    config = ModelConfig.from_pretrained(model_dir)
    work = workload(args, config.vocab_size)
    total_prompt = sum(len(p) for p, _ in work)
    total_out = sum(m for _, m in work)
    log(
        f"workload: {len(work)} prompts, {total_prompt} prompt tokens, {total_out} output tokens; "
        f"model {config.num_parameters / 1e6:.0f}M parameters, {args.dtype}, quantization "
        f"{args.quantization}, {torch.get_num_threads()} threads"
    )

    if args.decode_only:
        args.skip_transformers = True
        work = [(p[:32], 4) for p, _ in work[:2]]  # only loads and warms the engine up
    if baseline:  # float32 before and after the engine measured: the load's drift shows in the two
        log("float32 engine (the baseline), before")
        before_s, base_tok, base_llm = run_engine(args, model_dir, work)
        del base_llm
    eng_s, eng_tok, llm = run_engine(
        args, model_dir, work, args.dtype, args.quantization, args.kv_cache_dtype
    )
    log(f"engine: {eng_tok} tokens in {eng_s:.1f}s")
    if baseline:
        log("float32 engine (the baseline), after")
        after_s, _, base_llm = run_engine(args, model_dir, work)
        base_s = (before_s + after_s) / 2
        base_weights = weight_bytes_per_decode_step(base_llm.engine.model)
    log("decode step at batch 1" + (", steps taken in turn with the float32 engine's" if baseline else ""))
    engines = (llm, base_llm) if baseline else (llm,)
    (step_s, best_step_s, step_load, paired), *base = decode_step_times(
        *engines, probe=memory_floor.CopyProbe()
    )
    if baseline:
        ((base_step_s, base_best_s, _, base_paired),) = base
    log(f"decode step at batch {args.decode_batch}")
    (wide_s, _, wide_load, _), *base_wide = decode_step_times(*engines, steps=16, batch=args.decode_batch)
    if baseline:
        del base_llm
    model = llm.engine.model
    weights = weight_bytes_per_decode_step(model)
    log("memory bandwidth: copy, read, GEMV")
    copy_bw, read_bw = memory_floor.copy_bandwidth(), memory_floor.read_bandwidth()
    gemvs = {"torch F.linear": memory_floor.gemv_bandwidth(config.hidden_size, model.dtype)}
    if model.dtype == torch.float32 and native_build.available():
        gemvs["native"] = memory_floor.gemv_bandwidth(config.hidden_size, model.dtype, cpu_native.gemv)
    if model.dtype == torch.bfloat16 and native_build.available():
        gemvs["native bf16"] = memory_floor.gemv_bandwidth(config.hidden_size, model.dtype, cpu_bf16.gemv)
    if args.quantization == "int8" and native_build.available():
        ones = torch.ones(1 << 20)
        gemvs["native int8"] = memory_floor.gemv_bandwidth(
            config.hidden_size,
            torch.int8,
            lambda x, w: cpu_native.gemv_int8(x, w, ones[: w.shape[0]]),
        )
    if not args.skip_transformers:
        hf_s, hf_tok = run_transformers(args, model_dir, work)

    rows = []
    if not args.decode_only:
        rows.append(
            ("engine output tokens/s", f"{eng_tok / eng_s:.1f}", f"{eng_tok} tokens in {eng_s:.1f} s")
        )
    if not args.skip_transformers:
        rows.append(
            ("transformers output tokens/s", f"{hf_tok / hf_s:.1f}", f"{hf_tok} tokens in {hf_s:.1f} s")
        )
        rows.append(
            ("ratio engine / transformers", f"{(eng_tok / eng_s) / (hf_tok / hf_s):.2f}x", "target >= 2.5x")
        )
    dt = str(model.dtype).removeprefix("torch.")
    if args.quantization != "none":
        dt += f" + {args.quantization} weights"
    if args.kv_cache_dtype != "auto":
        dt += f" + {args.kv_cache_dtype} KV"
    if baseline:
        rows += [
            ("float32 engine output tokens/s", f"{base_tok / base_s:.1f}",
             f"same workload, mean of a run before ({base_tok / before_s:.1f}) and after ({base_tok / after_s:.1f})")
            if not args.decode_only
            else ("float32 engine", "-", "throughput not run (--decode-only)"),
            ("float32 decode step, batch 1", f"{base_step_s * 1e3:.2f} ms",
             f"best {base_best_s * 1e3:.2f} ms; weights {base_weights / 2**20:.0f} MiB"),
            ("speed-up of decode step vs float32", f"{base_step_s / step_s:.2f}x",
             f"best steps: {base_best_s / best_step_s:.2f}x; weight bytes {base_weights / weights:.2f}x fewer"),
        ]  # fmt: skip
        if not args.decode_only:
            rows.append(("throughput vs float32", f"{(eng_tok / eng_s) / (base_tok / base_s):.2f}x", ""))
    rows += [
        ("decode step, batch 1", f"{step_s * 1e3:.2f} ms", f"median engine.step(); load {step_load:.2f}"),
        ("  best step", f"{best_step_s * 1e3:.2f} ms", "shortest of the same steps"),
        (f"decode step, batch {args.decode_batch}", f"{wide_s * 1e3:.2f} ms",
         f"median of 16; load {wide_load:.2f}" + (f"; float32 {base_wide[0][0] * 1e3:.2f} ms, "
                                                 f"{base_wide[0][0] / wide_s:.2f}x" if baseline else "")),
        ("weights read per step", f"{weights / 2**20:.0f} MiB", f"{dt}: layers + final norm + LM head"),
        ("copy bandwidth", f"{copy_bw.gbps:.1f} GB/s",
         f"read + written (STREAM), 1 GiB random, best of 5; load {copy_bw.load:.2f}"),
        ("read bandwidth", f"{read_bw.gbps:.1f} GB/s", f"sum over 1 GiB random, best of 5; load {read_bw.load:.2f}"),
    ]  # fmt: skip
    for name, bw in gemvs.items():
        rows.append(
            (f"GEMV bandwidth, {name}", f"{bw.gbps:.1f} GB/s",
             f"256 MiB {dt} weight x 1 vector, best of 5; load {bw.load:.2f}")
        )  # fmt: skip
    copy_floor, read_floor = weights / copy_bw.bytes_per_s, weights / read_bw.bytes_per_s
    rows += [
        ("copy floor", f"{copy_floor * 1e3:.2f} ms", "weights / copy bandwidth"),
        ("read floor", f"{read_floor * 1e3:.2f} ms", "weights / read bandwidth"),
        ("decode step / copy floor", f"{step_s / copy_floor:.2f}x", "target <= 1.2x (best step: "
         f"{best_step_s / copy_floor:.2f}x)" + ("; int8 / bf16 target <= 1.3x" if args.quantization == "int8" or dt == "bfloat16" else "")),
        ("decode step / copy floor, paired", f"{paired:.2f}x",
         "median over steps of step ÷ floor at a 256 MiB copy sampled just before it"
         + (f"; float32 {base_paired:.2f}x" if baseline else "")),
        ("decode step / read floor", f"{step_s / read_floor:.2f}x", ""),
        (f"batch-{args.decode_batch} step / copy floor", f"{wide_s / copy_floor:.2f}x",
         "the weights are still read once; KV reads and compute come on top"),
    ]  # fmt: skip
    for name, bw in gemvs.items():
        rows.append((f"decode step / GEMV floor, {name}", f"{step_s * bw.bytes_per_s / weights:.2f}x",
                     f"floor {weights / bw.bytes_per_s * 1e3:.2f} ms"))  # fmt: skip
    what = (
        "batch-1 decode step only"
        if args.decode_only
        else f"{len(work)} prompts ({args.min_prompt}-{args.max_prompt} tokens), "
        f"{args.min_output}-{args.max_output} new tokens each"
    )
    print(f"\nengine benchmark: {what}, {config.num_parameters / 1e6:.0f}M {dt}, "
          f"{torch.get_num_threads()} threads; 1-min load average {load_before:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end")  # fmt: skip
    print(f"  on {cpu_name()}; kernels: {kernel_report()}")
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    for name, value, note in rows:
        print(f"  {name:<{w0}}  {value:>{w1}}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
