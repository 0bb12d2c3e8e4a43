"""The native small-M GEMM (`cpu_native.gemm`) against torch's `F.linear`, float32, on this CPU.

    python bench/small_gemm.py [--threads 2] [--rows 1,4,5,8,16,32,64] [--repeats 7]

For each matmul of the `small` preset (qkv, o, gate/up, down, LM head: y = x W^T, W [N, K]) and
each row count M, prints GFLOP/s of both and their ratio; each figure is the best of `--repeats`
timed loops, the two interleaved so that a burst of load from elsewhere hits both alike. The
1-min load average is printed before and after: on a shared machine read the ratios, not the
absolute figures.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch
import torch.nn.functional as F

# (name, N, K) of the small preset: hidden 768, 12 q / 4 kv heads of 64, intermediate 2048, vocab 32000
SHAPES = [
    ("qkv", 1280, 768),
    ("o", 768, 768),
    ("gate_up", 4096, 768),
    ("down", 768, 2048),
    ("lm_head", 32000, 768),
]


def loop_seconds(fn, flops: float) -> float:
    """Seconds per call of a loop sized to about 20 ms."""
    fn()
    iters = max(1, min(200, int(20e-3 * 100e9 / flops)))
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", default="1,2,4,5,8,12,16,24,32,48,64")
    ap.add_argument("--shapes", default=",".join(name for name, _, _ in SHAPES))
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from disagg.kernels import cpu_native

    if not cpu_native.available():
        print("native CPU kernels unavailable here (no C compiler?)")
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    wanted = set(args.shapes.split(","))
    gen = torch.Generator().manual_seed(0)
    print(
        f"float32 y = x W^T, {torch.get_num_threads()} threads; 1-min load average {os.getloadavg()[0]:.2f}"
    )
    print(f"  {'matmul':<8} {'N x K':>11} {'M':>3} {'native GF/s':>12} {'torch GF/s':>11} {'ratio':>6}")
    for name, n, k in SHAPES:
        if name not in wanted:
            continue
        w = torch.randn(n, k, generator=gen)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            flops = 2.0 * m * n * k
            ours, theirs = functools.partial(cpu_native.gemm, x, w), functools.partial(F.linear, x, w)
            native = torch_ = float("inf")
            for _ in range(args.repeats):
                native = min(native, loop_seconds(ours, flops))
                torch_ = min(torch_, loop_seconds(theirs, flops))
            print(
                f"  {name:<8} {f'{n}x{k}':>11} {m:>3} {flops / native / 1e9:>12.1f} "
                f"{flops / torch_ / 1e9:>11.1f} {torch_ / native:>6.2f}"
            )
    print(f"1-min load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
