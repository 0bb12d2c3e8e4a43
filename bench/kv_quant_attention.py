"""Native paged decode attention over a quantized KV cache (int8, fp8) against the float32 one.

    python bench/kv_quant_attention.py [--shapes 1x512,1x2048,16x1024] [--reps 40]

One layer of the small preset's attention (12 query heads, 4 KV heads, head dim 64, block size
16); each shape is BxL: B sequences of L cached tokens. The three kernels run on the same K/V
(the quantized caches hold it rounded) in the same command; printed: median ms and speed
against float32, with the thread count the kernel chose and the load average.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from disagg.kernels import cpu_kv_quant, cpu_native, native_build
from disagg.kernels.kv_quant import KVQuantFormat
from disagg.worker.model.precisions import KV_CACHE_DTYPES

HQ, HKV, D, BS = 12, 4, 64, 16


def _median_seconds(attention, cache: torch.Tensor, q: torch.Tensor, reps: int) -> float:
    attention(q, cache, D**-0.5)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        attention(q, cache, D**-0.5)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1x512,1x2048,16x1024", help="BxL, comma-separated")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args(argv)
    if not native_build.available():
        raise SystemExit("native kernels unavailable (no C compiler?)")
    g = torch.Generator().manual_seed(0)
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
    )
    for shape in args.shapes.split(","):
        b, length = (int(x) for x in shape.split("x"))
        blocks = b * -(-length // BS)
        tables = torch.arange(blocks, dtype=torch.int32).view(b, -1)
        lens = torch.full((b,), length, dtype=torch.int32)
        q = torch.randn(b, HQ, D, generator=g)
        cache = torch.randn(blocks, 2, BS, HKV, D, generator=g)
        plain = cpu_native.PagedDecodeAttention(tables, lens, HQ, HKV, blocks)
        times = {"float32": _median_seconds(plain, cache, q, args.reps)}
        for name in KV_CACHE_DTYPES:
            fmt = KVQuantFormat(name, BS, HKV, D)
            quantized = fmt.allocate(1, blocks, "cpu")[0]
            k, v = cache[:, 0].reshape(-1, HKV, D), cache[:, 1].reshape(-1, HKV, D)
            fmt.write(k, v, quantized, torch.arange(blocks * BS))
            attn = cpu_kv_quant.QuantizedPagedDecodeAttention(fmt, tables, lens, HQ, HKV, blocks)
            times[name] = _median_seconds(attn, quantized, q, args.reps)
        row = ", ".join(f"{n} {s * 1e3:.3f} ms ({times['float32'] / s:.2f}x)" for n, s in times.items())
        print(f"B={b} L={length} (threads {plain.threads}): {row}")
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
