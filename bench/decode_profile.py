"""Where one decode step (batch 1 unless `--batch N`) of the engine spends its time, op by op.

    python bench/decode_profile.py [--steps 32] [--threads 2] [--batch 32] [--dtype bfloat16] [--quantization int8]

Runs the `small` preset (float32 unless `--dtype`; 8-bit weights with `--quantization`) through `LLMEngine.step()` with one sequence and the torch
profiler on: torch ops are recorded as they are; the engine's phases (schedule, batch building,
forward, sampling, output) and the native kernels' ctypes calls are wrapped in named ranges here; the whole-step native decode
kernel, when it runs, also reports its own phases (qkv, attention, ... LM head).
Prints each op's time per step (self time: a range's children are not counted twice). The
profiler adds a few microseconds per op, so the total runs above an unprofiled step: the shares
are what to read. The 1-min load average is printed beside the table.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from disagg.worker.model.precisions import QUANTIZATIONS

ROOT = Path(__file__).resolve().parent.parent

from bench_model import ensure_model  # noqa: E402


def _ranged(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def instrument(engine) -> None:
    """Named ranges around the engine's phases and every native kernel call."""
    from disagg.kernels import cpu_bf16, cpu_decode_step, cpu_native
    from disagg.worker.engine import llm_engine

    for name in ("add_rms_norm", "silu_and_mul", "rotary_write_kv", "check_step_bounds"):
        setattr(cpu_native, name, _ranged(f"native::{name}", getattr(cpu_native, name)))
    for name in ("add_rms_norm", "silu_and_mul", "rotary_write_kv", "gemv"):
        setattr(cpu_bf16, name, _ranged(f"native bf16::{name}", getattr(cpu_bf16, name)))
    gemm = cpu_native.gemm

    def gemm_by_shape(x, weight, bias=None):  # one row per weight shape, as aten::mm's
        with record_function(f"native::gemm {'x'.join(map(str, weight.shape))}"):
            return gemm(x, weight, bias)

    cpu_native.gemm = gemm_by_shape
    for cls in (
        cpu_native.PagedDecodeAttention,
        cpu_bf16.PagedDecodeAttention,
        cpu_decode_step.NativeDecodeStep,
    ):
        cls.__call__ = _ranged(f"native::{cls.__name__}", cls.__call__)
    llm_engine.build_batch = _ranged("engine::build_batch", llm_engine.build_batch)
    engine.scheduler.schedule = _ranged("engine::schedule", engine.scheduler.schedule)
    engine.runner.forward = _ranged("engine::forward (Python)", engine.runner.forward)
    engine.sampler = _ranged("engine::sample", engine.sampler)
    engine.outputs.process = _ranged("engine::append_token", engine.outputs.process)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        type=Path,
        default=ROOT / ".models" / "small",
        help="checkpoint (default: the preset, made once)",
    )
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, default=25, help="table rows printed")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--quantization", default="none", choices=("none", *QUANTIZATIONS))
    ap.add_argument(
        "--per-op",
        action="store_true",
        help="decode through the per-op path (torch matmuls, native small ops)",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from disagg.kernels.cpu_decode_step import PHASES
    from disagg.worker import LLM, SamplingParams

    model = ensure_model(args.model, args.preset)
    engine = LLM(model=str(model), dtype=args.dtype, quantization=args.quantization).engine
    params = SamplingParams(temperature=0.0, max_tokens=2 * args.steps + 8, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"profile-{i}", list(range(10 + i, 138 + i)), params)
    for _ in range(args.steps):  # prefill and warm-up
        engine.step()
    if args.per_op:
        engine.runner.model._whole_step_native = False
    instrument(engine)
    phases = None
    model = engine.runner.model
    if (
        model._native_ok(engine.runner.kv_cache) and model._whole_step_native and not args.per_op
    ):  # the whole-step kernel times its own phases
        phases = model.native_decode_step().phase_seconds = torch.zeros(len(PHASES), dtype=torch.float64)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(args.steps):
            with record_function("engine::step (rest)"):
                engine.step()
    events = prof.key_averages(group_by_input_shape=True)
    total = sum(e.self_cpu_time_total for e in events)
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.rows]
    print(
        f"\none batch-{args.batch} {args.dtype} decode step, profiled over {args.steps} steps, {torch.get_num_threads()} threads; "
        f"1-min load average {os.getloadavg()[0]:.2f}; total {total / args.steps / 1e3:.2f} ms/step"
    )
    print(f"  {'op':<24} {'shapes':<28} {'calls':>5} {'ms/step':>8} {'share':>6}")
    for e in rows:
        per_step = e.self_cpu_time_total / args.steps
        shapes = "x".join(str(s) for s in e.input_shapes[:2] if s) if e.key == "aten::mm" else ""
        print(
            f"  {e.key[:24]:<24} {shapes[:28]:<28} {e.count // args.steps:>5} {per_step / 1e3:>8.3f} "
            f"{e.self_cpu_time_total / total:>6.1%}"
        )
    if phases is not None and phases.sum() > 0:
        print(
            "  inside native::NativeDecodeStep, by phase (thread 0's clock; a phase holds its closing barrier):"
        )
        for name, seconds in zip(PHASES, phases.tolist(), strict=True):
            print(f"    {name:<38} {seconds / args.steps * 1e3:>8.3f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
