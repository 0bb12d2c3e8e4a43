"""The native small-M GEMM (`cpu_native.gemm`) against torch's `F.linear`, float32, on this CPU.

    python bench/small_gemm.py [--threads 2] [--rows 1,4,5,8,16,32,64] [--repeats 7] [--hot] [--int8]
    python bench/small_gemm.py --dtype bfloat16   # the native bf16 GEMV and GEMM against torch's bf16 GEMM
    python bench/small_gemm.py --thresholds [--quick]   # the crossover behind each row threshold

Without AVX-512 the float32 table's last column is the packed-panel GEMM (`cpu_native.gemm_packed`,
what `linear` takes beyond `quantized.GEMM_NATIVE_MAX_ROWS_AVX2` rows there) instead of the GEMV.

For each matmul of the `small` preset (qkv, o, gate/up, down, LM head: y = x W^T, W [N, K]) and
each row count M, prints GFLOP/s of both (and of the native GEMV, `cpu_native.gemv`, for a few
rows) and their ratio; each figure is the best of `--repeats` timed loops, the two interleaved
so that a burst of load from elsewhere hits both alike. As in a decode step, where each weight is
read once from memory (the model is far larger than the L3 cache), the calls cycle through
copies of the weight that together exceed the L3; `--hot` times one copy, cache-resident. The
1-min load average is printed before and after: on a shared machine read the ratios, not the
absolute figures.

`--int8` times the int8-weight products instead, each against the native float32 GEMM on the same
shape (ratio = float32 time / int8 time): the W8A8 GEMM (`cpu_native.gemm_int8`, VPDPBUSD; where
the CPU has AVX-512 VNNI), the same GEMM with 16-bit inputs as two byte planes (A16x2:
`input_bits=16`), the int8 GEMV (W8A16), the packed-panel GEMM (without AVX-512), the weight widened to float32 for torch's GEMM on each
call (widen: the torch twin), and torch's GEMM on float32 weights (torch).

`--thresholds` prints, for every row threshold of `disagg.kernels.quantized` (the row count M at
which a weight's plan changes kernel), the two kernels on either side of it timed at rows around
it: seconds per call of each, their ratio (time of the kernel beyond / time of the kernel up to
the threshold: above 1 the lower-rows kernel is faster), the kernel the threshold picks and the
faster one. A threshold whose kernels this CPU does not run (AVX2-only ones on an AVX-512 build,
VNNI ones without VNNI) says so; `DISAGG_CPU_NATIVE_ARCH=x86-64-v3` builds the kernels for AVX2 to
time those here. `--quick`: one 768 x 768 weight, cache-resident, 3 repeats (seconds).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from machine import cpu_name  # noqa: E402

# (name, N, K) of the small preset: hidden 768, 12 q / 4 kv heads of 64, intermediate 2048, vocab 32000
SHAPES = [
    ("qkv", 1280, 768),
    ("o", 768, 768),
    ("gate_up", 4096, 768),
    ("down", 768, 2048),
    ("lm_head", 32000, 768),
]


# Bytes of weight copies cycled through per matmul: beyond any L3 here, so each call reads from memory.
COLD_BYTES = 256 << 20
# Up to this many rows the GEMV is timed too (beyond, it only reads the inputs more times).
GEMV_MAX_ROWS = 16


def loop_seconds(fn, weights: list[torch.Tensor], x: torch.Tensor, flops: float) -> float:
    """Seconds per call of a loop of about 20 ms, each call on the next weight copy."""
    fn(x, weights[0])
    iters = max(len(weights), min(200, int(20e-3 * 100e9 / flops)))
    start = time.perf_counter()
    for i in range(iters):
        fn(x, weights[i % len(weights)])
    return (time.perf_counter() - start) / iters


def int8_table(cpu_native, rows: list[int], wanted: set[str], args, gen: torch.Generator) -> None:
    from disagg.kernels.quantized import QuantizedWeight, scaled_linear_torch

    vnni = cpu_native.gemm_int8_is_fast()
    print(
        f"int8 weights, float32 inputs, {torch.get_num_threads()} threads, weights "
        f"{'hot' if args.hot else 'cold'}; VNNI {vnni}; "
        f"1-min load average {os.getloadavg()[0]:.2f}"
    )
    # without VNNI the W8A8 GEMM sums in plain loops (not a path `linear` takes): not timed there
    columns = [("W8A8", 5), ("A16x2", 6)] if vnni else []
    columns += [("GEMV", 5)]
    if cpu_native.narrow_tiles():  # without AVX-512: the packed-panel GEMM, int8 widened as packed
        columns += [("packed", 6)]
    columns += [("widen", 5), ("torch", 5)]
    head = " ".join(f"{key:>{width}}" for key, width in columns)
    print(f"  {'matmul':<8} {'N x K':>11} {'M':>4} {'f32 GF/s':>9}   x f32: {head}")
    for name, n, k in SHAPES:
        if name not in wanted:
            continue
        copies = 1 if args.hot else -(-COLD_BYTES // (n * k))
        floats = [torch.randn(n, k, generator=gen) for _ in range(max(1, copies // 4))]
        ints = [torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8) for _ in range(copies)]
        scale = torch.rand(n, generator=gen) / 127
        sums = {id(w): w.sum(1, dtype=torch.int32) for w in ints}
        kernels = {
            "W8A8": (ints, lambda x, w, s=scale, sums=sums: cpu_native.gemm_int8(x, w, s, sums[id(w)])),
            "A16x2": (
                ints,
                lambda x, w, s=scale, sums=sums: cpu_native.gemm_int8(x, w, s, sums[id(w)], input_bits=16),
            ),
            "GEMV": (ints, lambda x, w, s=scale: cpu_native.gemv_int8(x, w, s)),
            "packed": (ints, lambda x, w, s=scale: cpu_native.gemm_packed(x, w, scale=s)),
            # the twin: the int8 weight widened to float32 for torch's GEMM on every call
            "widen": (ints, lambda x, w, s=scale: scaled_linear_torch(x, QuantizedWeight(w, s))),
            "torch": (floats, F.linear),  # float32 weights through torch's GEMM
        }
        kernels = {key: kernels[key] for key, _ in columns}
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            flops = 2.0 * m * n * k
            best = dict.fromkeys(["f32", *kernels], float("inf"))
            for _ in range(args.repeats):  # interleaved: a burst of load hits all alike
                best["f32"] = min(best["f32"], loop_seconds(cpu_native.gemm, floats, x, flops))
                for key, (weights, fn) in kernels.items():
                    best[key] = min(best[key], loop_seconds(fn, weights, x, flops))
            ratios = " ".join(f"{best['f32'] / best[key]:>{width}.2f}" for key, width in columns)
            print(f"  {name:<8} {f'{n}x{k}':>11} {m:>4} {flops / best['f32'] / 1e9:>9.1f}   x f32: {ratios}")


@dataclass(frozen=True)
class Threshold:
    """`quantized.<name>`: inputs of up to `last_lower` rows take `lower`, more rows `upper`."""

    name: str
    last_lower: int
    weight: str  # float32 | bfloat16 | int8 | fp8
    lower: str  # a kernel of `quantized` (x, w, bias, w8a8)
    upper: str
    missing: str | None = None  # why this CPU does not run these kernels (None: it does)

    def rows(self) -> list[int]:
        t = self.last_lower
        return sorted({r for r in (t // 4, t // 2, t, t + 1, 2 * (t + 1)) if r >= 1})


def thresholds(quantized, cpu_native, cpu_bf16, native_build) -> list[Threshold]:
    """Every row threshold with the kernels on its two sides on this CPU."""
    wide, narrow = cpu_native.gemm_vector_floats() >= 16, cpu_native.narrow_tiles()
    vnni = (
        cpu_native.gemm_int8_is_fast() and not cpu_native.narrow_tiles()
    )  # AVX2 builds have a fast W8A8 path only
    bf16_dot, amx = cpu_bf16.dot_native(), native_build.amx_usable()
    no_avx2_build = "the kernels are built for AVX-512 here (DISAGG_CPU_NATIVE_ARCH=x86-64-v3: AVX2)"
    q = quantized
    return [
        Threshold("GEMM_NATIVE_MAX_ROWS", q.GEMM_NATIVE_MAX_ROWS, "float32", "native_gemm", "torch_gemm",
                  None if wide else "needs the AVX-512 build"),
        Threshold("GEMM_NATIVE_MAX_ROWS_AVX2", q.GEMM_NATIVE_MAX_ROWS_AVX2, "float32", "native_gemm",
                  "packed_gemm", None if narrow else no_avx2_build),
        Threshold("BF16_GEMV_MAX_ROWS", q.BF16_GEMV_MAX_ROWS, "bfloat16", "bf16_gemv",
                  "torch_gemm" if bf16_dot else "bf16_gemm", "AMX is usable here: BF16_AMX_* apply" if amx else None),
        Threshold("BF16_AMX_MIN_ROWS", q.BF16_AMX_MIN_ROWS - 1, "bfloat16", "bf16_gemv", "bf16_amx",
                  None if amx else "needs AMX (granted and probed)"),
        Threshold("BF16_AMX_MAX_ROWS", q.BF16_AMX_MAX_ROWS, "bfloat16", "bf16_amx", "torch_gemm",
                  None if amx else "needs AMX (granted and probed)"),
        Threshold("W8A8_MIN_ROWS", q.W8A8_MIN_ROWS - 1, "int8", "int8_gemv", "int8_amx" if amx else "int8_gemm",
                  None if vnni else "needs AVX-512 VNNI"),
        Threshold("INT8_AMX_MAX_ROWS", q.INT8_AMX_MAX_ROWS, "int8", "int8_amx", "bf16_product",
                  None if amx else "needs AMX (granted and probed)"),
        Threshold("BF16_PRODUCT_MIN_ROWS", q.BF16_PRODUCT_MIN_ROWS - 1, "int8",
                  "int8_gemm" if vnni else "int8_gemv", "bf16_product",
                  None if bf16_dot else "needs bf16 products (AVX-512 BF16)"),
        Threshold("GEMM_INT8_MAX_ROWS", q.GEMM_INT8_MAX_ROWS, "int8", "int8_gemm", "twin",
                  None if vnni else "needs AVX-512 VNNI"),
        Threshold("NATIVE_MAX_ROWS", q.NATIVE_MAX_ROWS, "int8", "int8_gemv", "twin",
                  None if vnni else "needs AVX-512 VNNI"),
        Threshold("GEMV_INT8_MAX_ROWS_NO_VNNI", q.GEMV_INT8_MAX_ROWS_NO_VNNI, "int8", "int8_gemv", "twin",
                  "this CPU has VNNI" if vnni else "AVX2 tiles: GEMV_INT8_MAX_ROWS_AVX2" if narrow else None),
        Threshold("GEMV_INT8_MAX_ROWS_AVX2", q.GEMV_INT8_MAX_ROWS_AVX2, "int8", "int8_gemv", "packed_8bit_gemm",
                  None if narrow else "needs AVX2 tiles (DISAGG_CPU_NATIVE_ARCH=x86-64-v3)"),
        Threshold("FP8_NATIVE_MAX_ROWS", q.FP8_NATIVE_MAX_ROWS, "fp8", "fp8_gemv",
                  "packed_8bit_gemm" if narrow else "fp8_widened"),
    ]  # fmt: skip


def threshold_tables(shapes: list[tuple[str, int, int]], args, gen: torch.Generator) -> None:
    from disagg.kernels import cpu_bf16, cpu_native, native_build, quantized

    print(
        f"row thresholds of disagg.kernels.quantized on {cpu_name()}: AVX-512 tiles "
        f"{cpu_native.gemm_vector_floats() >= 16}, VNNI {cpu_native.gemm_int8_is_fast()}, bf16 products "
        f"{cpu_bf16.dot_native()}, AMX {native_build.amx_usable()}; {torch.get_num_threads()} threads, "
        f"weights {'hot' if args.hot else 'cold'}; 1-min load average {os.getloadavg()[0]:.2f}"
    )
    print("  ratio: time beyond / time up to the threshold (above 1: the lower-rows kernel is faster)")
    for t in thresholds(quantized, cpu_native, cpu_bf16, native_build):
        print(f"{t.name} = {getattr(quantized, t.name)} ({t.weight} weights): {t.lower} | {t.upper}")
        if t.missing:
            print(f"  not timed: {t.missing}")
            continue
        lower = functools.partial(getattr(quantized, t.lower), bias=None, w8a8=False)
        upper = functools.partial(getattr(quantized, t.upper), bias=None, w8a8=False)
        col = max(len(t.lower), len(t.upper)) + 3
        print(
            f"  {'N x K':>11} {'M':>5} {t.lower + ' ms':>{col}} {t.upper + ' ms':>{col}} {'ratio':>6} "
            f"{'picks':>{col}} {'faster':>{col}}"
        )
        for _, n, k in shapes:
            nbytes = n * k * {"float32": 4, "bfloat16": 2}.get(t.weight, 1)
            weights = _weights(t.weight, n, k, 1 if args.hot else -(-COLD_BYTES // nbytes), gen)
            for m in t.rows():
                x = torch.randn(m, k, generator=gen).to(
                    torch.bfloat16 if t.weight == "bfloat16" else torch.float32
                )
                flops = 2.0 * m * n * k
                low = high = float("inf")
                for _ in range(args.repeats):  # interleaved: a burst of load hits both alike
                    low = min(low, loop_seconds(lower, weights, x, flops))
                    high = min(high, loop_seconds(upper, weights, x, flops))
                picks = t.lower if m <= t.last_lower else t.upper
                faster = t.lower if low <= high else t.upper
                print(
                    f"  {f'{n}x{k}':>11} {m:>5} {low * 1e3:>{col}.3f} {high * 1e3:>{col}.3f} "
                    f"{high / low:>6.2f} {picks:>{col}} {faster:>{col}}"
                )


def _weights(kind: str, n: int, k: int, copies: int, gen: torch.Generator) -> list:
    """`copies` random weights [N, K] of `kind` (8-bit ones as `QuantizedWeight`)."""
    from disagg.kernels.quantized import QuantizedWeight

    out = []
    for _ in range(max(1, copies)):
        w = torch.randn(n, k, generator=gen)
        if kind in ("float32", "bfloat16"):
            out.append(w.to(getattr(torch, kind)))
            continue
        scale = w.abs().amax(1) / (127.0 if kind == "int8" else 448.0)
        values = w / scale[:, None]
        data = values.round().to(torch.int8) if kind == "int8" else values.to(torch.float8_e4m3fn)
        out.append(QuantizedWeight(data, scale))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", default="1,2,4,5,8,12,16,24,32,48,64")
    ap.add_argument("--shapes", default=",".join(name for name, _, _ in SHAPES))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--hot", action="store_true", help="one weight copy, resident in the caches")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--int8", action="store_true", help="int8-weight kernels against the float32 GEMM")
    ap.add_argument("--thresholds", action="store_true", help="the crossover behind each row threshold")
    ap.add_argument("--quick", action="store_true", help="--thresholds on one small hot weight, 3 repeats")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from disagg.kernels import cpu_bf16, cpu_native, native_build

    if not native_build.available():
        print("native CPU kernels unavailable here (no C compiler?)")
        return 1
    dtype = getattr(torch, args.dtype)
    # bf16: the native GEMV (`cpu_bf16.gemv`) at every M is the "native" column, and the last column
    # the native bf16 GEMM (`cpu_bf16.gemm`, what CPUs without bf16 products take beyond 8 rows)
    if args.dtype == "float32" and cpu_native.narrow_tiles():
        # without AVX-512 many rows take the packed-panel GEMM: the last column
        native_fn, third_fn, third_max_rows, third_name = (
            cpu_native.gemm,
            cpu_native.gemm_packed,
            1 << 30,
            "packed",
        )
    elif args.dtype == "float32":
        native_fn, third_fn, third_max_rows, third_name = (
            cpu_native.gemm,
            cpu_native.gemv,
            GEMV_MAX_ROWS,
            "GEMV",
        )
    else:
        native_fn, third_fn, third_max_rows, third_name = cpu_bf16.gemv, cpu_bf16.gemm, 1 << 30, "GEMM"
    rows = [int(r) for r in args.rows.split(",")]
    wanted = set(args.shapes.split(","))
    gen = torch.Generator().manual_seed(0)
    if args.thresholds:
        shapes = [s for s in SHAPES if s[0] in wanted and s[0] != "lm_head"]
        if args.quick:
            shapes, args.hot, args.repeats = [("o", 768, 768)], True, min(args.repeats, 3)
        threshold_tables(shapes, args, gen)
        print(f"1-min load average after: {os.getloadavg()[0]:.2f}")
        return 0
    if args.int8:
        int8_table(cpu_native, rows, wanted, args, gen)
        print(f"1-min load average after: {os.getloadavg()[0]:.2f}")
        return 0
    print(
        f"{args.dtype} y = x W^T, {torch.get_num_threads()} threads, weights {'hot' if args.hot else 'cold'}; "
        f"1-min load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"  {'matmul':<8} {'N x K':>11} {'M':>4} {'native GF/s':>12} {'torch GF/s':>11} {'ratio':>6} "
        f"{third_name + ' GF/s':>11}"
    )
    for name, n, k in SHAPES:
        if name not in wanted:
            continue
        copies = 1 if args.hot else -(-COLD_BYTES // (n * k * dtype.itemsize))
        weights = [torch.randn(n, k, generator=gen).to(dtype) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(dtype)
            flops = 2.0 * m * n * k
            native = torch_ = third = float("inf")
            for _ in range(args.repeats):
                native = min(native, loop_seconds(native_fn, weights, x, flops))
                torch_ = min(torch_, loop_seconds(F.linear, weights, x, flops))
                if m <= third_max_rows:
                    third = min(third, loop_seconds(third_fn, weights, x, flops))
            print(
                f"  {name:<8} {f'{n}x{k}':>11} {m:>4} {flops / native / 1e9:>12.1f} "
                f"{flops / torch_ / 1e9:>11.1f} {torch_ / native:>6.2f} "
                + (f"{flops / third / 1e9:>11.1f}" if m <= third_max_rows else f"{'-':>11}")
            )
    print(f"1-min load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
