"""Attention kernel throughput on a CUDA GPU, against the device's peak and the torch twins.

    python bench/kernels.py [--dtype bfloat16] [--iters 50]

Decode attention is memory bound: it prints achieved bandwidth (bytes of K/V read / time).
Prefill attention is compute bound: it prints TFLOP/s (causal: 2 matmuls over half the
score matrix). Both as a fraction of the device peak, taken from a table by device name, or
measured (a large device copy, a large matmul) for devices not in the table. The torch twins
run in the same command as the baseline. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys

import torch

# (substrings of torch.cuda.get_device_name, HBM GB/s, dense bf16 tensor TFLOP/s); first match wins
PEAKS = [
    (("H100", "PCIe"), 2000.0, 756.0),
    (("H100",), 3350.0, 989.0),
    (("H200",), 4800.0, 989.0),
    (("A100", "40GB"), 1555.0, 312.0),
    (("A100", "PCIe"), 1935.0, 312.0),
    (("A100",), 2039.0, 312.0),
    (("L40S",), 864.0, 362.0),
    (("L4",), 300.0, 121.0),
]

DECODE_SHAPES = [  # (batch, q heads, kv heads, head dim, context, block size)
    (1, 32, 8, 128, 32768, 16),
    (8, 32, 8, 128, 8192, 16),
    (64, 32, 8, 128, 2048, 16),
    (256, 32, 8, 128, 1024, 16),
]
PREFILL_SHAPES = [  # (prompts, prompt length, q heads, kv heads, head dim)
    (1, 8192, 32, 8, 128),
    (8, 2048, 32, 8, 128),
    (32, 512, 32, 8, 128),
]


def cuda_time_ms(fn, iters: int) -> float:
    fn()  # compile / warm up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def device_peaks(iters: int) -> tuple[float, float, str]:
    name = torch.cuda.get_device_name()
    for keys, gbps, tflops in PEAKS:
        if all(k in name for k in keys):
            return gbps, tflops, f"{name} (table)"
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    gbps = 2 * src.numel() / cuda_time_ms(lambda: dst.copy_(src), iters) / 1e6
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    tflops = 2 * 8192**3 / cuda_time_ms(lambda: a @ a, max(3, iters // 10)) / 1e9
    return gbps, tflops, f"{name} (measured copy bandwidth and bf16 matmul)"


def paged_decode_inputs(batch, hq, hkv, d, context, page, dtype):
    blocks_per_seq = (context + page - 1) // page
    cache = torch.randn(batch * blocks_per_seq, 2, page, hkv, d, dtype=dtype, device="cuda")
    tables = torch.randperm(batch * blocks_per_seq, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
    q = torch.randn(batch, hq, d, dtype=dtype, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, cache, tables, seq_lens


def bench_decode(peak_gbps: float, dtype, iters: int) -> None:
    from disagg.kernels import torch_ops
    from disagg.kernels.triton_decode_attention import paged_decode_attention

    print("\ndecode attention (paged, GQA)")
    print(
        f"{'B':>4} {'Hq/Hkv':>7} {'D':>4} {'ctx':>6} {'splits':>6} {'triton ms':>10} {'GB/s':>8} {'%peak':>6} {'torch ms':>9} {'speedup':>8}"
    )
    for batch, hq, hkv, d, context, page in DECODE_SHAPES:
        q, cache, tables, lens = paged_decode_inputs(batch, hq, hkv, d, context, page, dtype)
        args = (q, cache, tables, lens, d**-0.5)
        kv_bytes = batch * context * hkv * d * 2 * cache.element_size()
        for splits in (1, None):
            ms = cuda_time_ms(lambda a=args, s=splits: paged_decode_attention(*a, num_splits=s), iters)
            try:
                base_ms = cuda_time_ms(lambda a=args: torch_ops.decode_attention(*a), iters)
                base, ratio = f"{base_ms:9.3f}", f"{base_ms / ms:7.2f}x"
            except torch.OutOfMemoryError:  # the twin materializes float32 copies of K and V
                base, ratio = f"{'oom':>9}", f"{'-':>8}"
            gbps = kv_bytes / ms / 1e6
            label = "1" if splits == 1 else "auto"
            print(
                f"{batch:4d} {hq:3d}/{hkv:<3d} {d:4d} {context:6d} {label:>6} {ms:10.3f} {gbps:8.0f}"
                f" {100 * gbps / peak_gbps:5.1f}% {base} {ratio}"
            )
        del q, cache, tables, lens, args
        torch.cuda.empty_cache()


def bench_prefill(peak_tflops: float, dtype, iters: int) -> None:
    from disagg.kernels import torch_ops
    from disagg.kernels.triton_prefill_attention import varlen_prefill_attention

    print("\nprefill attention (varlen, causal, GQA; float32 dot operands, so TF32 tensor cores)")
    print(
        f"{'seqs':>4} {'len':>6} {'Hq/Hkv':>7} {'D':>4} {'triton ms':>10} {'TFLOP/s':>8} {'%peak':>6} {'torch ms':>9} {'speedup':>8}"
    )
    for seqs, length, hq, hkv, d in PREFILL_SHAPES:
        total = seqs * length
        q = torch.randn(total, hq, d, dtype=dtype, device="cuda")
        k = torch.randn(total, hkv, d, dtype=dtype, device="cuda")
        v = torch.randn(total, hkv, d, dtype=dtype, device="cuda")
        cache = torch.empty(1, 2, 16, hkv, d, dtype=dtype, device="cuda")  # whole prompts: no prefix read
        tables = torch.zeros(seqs, 1, dtype=torch.int32, device="cuda")
        cu = torch.arange(0, total + 1, length, dtype=torch.int32, device="cuda")
        lens = torch.full((seqs,), length, dtype=torch.int32, device="cuda")
        args = (q, k, v, cache, tables, cu, lens, d**-0.5)
        flops = seqs * 4 * hq * d * length * (length + 1) / 2
        ms = cuda_time_ms(lambda a=args: varlen_prefill_attention(*a), iters)
        base = cuda_time_ms(lambda a=args: torch_ops.prefill_attention(*a), iters)
        tflops = flops / ms / 1e9
        print(
            f"{seqs:4d} {length:6d} {hq:3d}/{hkv:<3d} {d:4d} {ms:10.3f} {tflops:8.1f}"
            f" {100 * tflops / peak_tflops:5.1f}% {base:9.3f} {base / ms:7.2f}x"
        )
        del q, k, v, args
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench/kernels.py needs a CUDA GPU (the Triton kernels are proven on CPU by tests/kernels); skipping."
        )
        return 0
    dtype = getattr(torch, args.dtype)
    peak_gbps, peak_tflops, source = device_peaks(args.iters)
    print(f"device: {source}: {peak_gbps:.0f} GB/s, {peak_tflops:.0f} dense bf16 TFLOP/s; dtype {args.dtype}")
    bench_decode(peak_gbps, dtype, args.iters)
    bench_prefill(peak_tflops, dtype, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
