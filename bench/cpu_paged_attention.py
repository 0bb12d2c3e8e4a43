"""Native paged decode attention on this CPU, one layer, for every cache kind it reads.

    python bench/cpu_paged_attention.py [--kinds float32,bfloat16,int8,fp8] [--threads 1] [--reps 30] [--rounds 3]

Each case is one decode step's attention of one layer: B sequences of L cached tokens, Hq query
heads over Hkv KV heads of dimension D, blocks of 16 tokens in shuffled order (as a long-running
cache hands them out). Every kind reads the same K/V (bf16 and the 8-bit kinds rounded). Printed
per case and kind: the best of `--rounds` medians of `--reps` calls, and the K/V bytes read per
second at that time. D 64 and 128 take the unrolled (AVX-512: register-blocked) paths, D 80 the
generic loops; `DISAGG_CPU_NATIVE_ARCH=x86-64-v3` times the AVX2 build on an AVX-512 CPU. On a
shared machine `--threads 1` gives steadier figures: a thread of a parallel call that loses its
core holds up the whole call.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from machine import kernel_report

from disagg.kernels import cpu_bf16, cpu_kv_quant, cpu_native, native_build
from disagg.kernels.kv_quant import KVQuantFormat

BLOCK = 16
CASES = [  # (Hq, Hkv, D, B, L)
    (32, 8, 128, 1, 2048),
    (32, 8, 128, 8, 512),
    (32, 8, 128, 16, 1024),
    (12, 4, 64, 4, 1024),
    (8, 2, 80, 4, 512),
]
KINDS = ("float32", "bfloat16", "int8", "fp8")


def _best_median(call, reps: int, rounds: int) -> float:
    call()
    best = float("inf")
    for _ in range(rounds):
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        best = min(best, sorted(times)[len(times) // 2])
    return best


def _attention(kind: str, hq: int, hkv: int, d: int, cache, q, tables, lens, blocks):
    """(the call, the K/V bytes it reads) for one cache kind over the float32 `cache`."""
    tokens = int(lens.sum())
    if kind == "float32":
        attn = cpu_native.PagedDecodeAttention(tables, lens, hq, hkv, blocks)
        return lambda: attn(q, cache, d**-0.5), tokens * 2 * hkv * d * 4
    if kind == "bfloat16":
        attn = cpu_bf16.PagedDecodeAttention(tables, lens, hq, hkv, blocks)
        q16, cache16 = q.bfloat16(), cache.bfloat16()
        return lambda: attn(q16, cache16, d**-0.5), tokens * 2 * hkv * d * 2
    fmt = KVQuantFormat(kind, BLOCK, hkv, d)
    layer = fmt.allocate(1, blocks, "cpu")[0]
    fmt.write(
        cache[:, 0].reshape(-1, hkv, d), cache[:, 1].reshape(-1, hkv, d), layer, torch.arange(blocks * BLOCK)
    )
    attn = cpu_kv_quant.QuantizedPagedDecodeAttention(fmt, tables, lens, hq, hkv, blocks)
    return lambda: attn(q, layer, d**-0.5), tokens * 2 * hkv * (d + 4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of " + ", ".join(KINDS))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch's thread count")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"unknown kinds: {', '.join(sorted(unknown))}")
    torch.set_num_threads(args.threads)
    if not native_build.available():
        raise SystemExit("native kernels unavailable (no C compiler?)")
    print(kernel_report())
    print(f"load average {os.getloadavg()[0]:.2f}, torch threads {torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(0)
    for hq, hkv, d, b, length in CASES:
        per_seq = -(-length // BLOCK)
        blocks = b * per_seq
        tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(b, per_seq)
        lens = torch.full((b,), length, dtype=torch.int32)
        q = torch.randn(b, hq, d, generator=gen)
        cache = torch.randn(blocks, 2, BLOCK, hkv, d, generator=gen)
        cells = []
        for kind in kinds:
            call, nbytes = _attention(kind, hq, hkv, d, cache, q, tables, lens, blocks)
            seconds = _best_median(call, args.reps, args.rounds)
            cells.append(f"{kind} {seconds * 1e3:7.3f} ms {nbytes / seconds / 1e9:5.1f} GB/s")
        print(f"Hq={hq:2d} Hkv={hkv} D={d:3d} B={b:2d} L={length:4d}: " + " | ".join(cells))
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
