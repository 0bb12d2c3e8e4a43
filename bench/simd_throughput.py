"""Peak multiply-accumulates per nanosecond of one core, for each arithmetic a CPU matrix product
can be built on: what bounds a compute-bound product (prefill, large batches) with each weight type.

    python bench/simd_throughput.py [--iterations 50000000]

Builds bench/simd_throughput.c with the C compiler (`cc`, each probe compiled for its own
instruction set and run only where the CPU has it) and prints, per probe, MACs/ns and the ratio
to the float32 FMA of the same vector width. An 8-bit weight pays in compute only where its
integer dot product beats the float32 FMA: with AVX-512 VNNI, VPDPBUSD does 64 products per
instruction where an FMA does 16; with AVX2 alone, the int8 dot product is VPMADDUBSW (u8 x s8,
16-bit pair sums that saturate unless one side has 7 bits) widened by a VPMADDWD, and VPMADDWD
alone is AVX2's int16 product. One core, register operands only: memory plays no part.
The 1-min load average is printed: a busy core lowers every figure alike, so read the ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("simd_throughput.c")
# probe name -> (what it is, the float32 FMA probe of the same width)
PROBES = {
    "fma_f32_256": ("float32 FMA, AVX2", "fma_f32_256"),
    "maddwd_i16_256": ("int16 pairs: VPMADDWD + VPADDD, AVX2", "fma_f32_256"),
    "maddubs_u8s8_256": ("u8 x s8 pairs: VPMADDUBSW (16-bit sums), AVX2", "fma_f32_256"),
    "maddubs_widened_256": ("int8 dot: VPMADDUBSW + VPMADDWD(1) + VPADDD, AVX2", "fma_f32_256"),
    "fma_f32_512": ("float32 FMA, AVX-512", "fma_f32_512"),
    "dpbusd_u8s8_512": ("int8 dot: VPDPBUSD, AVX-512 VNNI", "fma_f32_512"),
    "dpwssd_i16_512": ("int16 dot: VPDPWSSD, AVX-512 VNNI", "fma_f32_512"),
    "dpbf16_bf16_512": ("bf16 dot: VDPBF16PS, AVX-512 BF16", "fma_f32_512"),
}


def build(out_dir: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("needs a C compiler (cc): apt-get install gcc")
    binary = out_dir / "simd_throughput"
    subprocess.run([cc, "-O2", "-o", str(binary), str(SOURCE)], check=True)
    return binary


def measure(iterations: int = 50_000_000) -> dict[str, float | None]:
    """MACs/ns of one core for each probe (None: not on this CPU)."""
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        lines = subprocess.run(
            [str(binary), str(iterations)], check=True, capture_output=True, text=True
        ).stdout.split()
    return {
        name: None if value == "-" else float(value)
        for name, _isa, value in zip(lines[0::3], lines[1::3], lines[2::3], strict=True)
    }


def fp32_fma_peak_gflops(
    threads: int, vector_floats: int = 16, iterations: int = 20_000_000
) -> tuple[float, str]:
    """The float32 FMA peak of `threads` cores (one core's rate times `threads`) on vectors of up to
    `vector_floats` floats (the widest this CPU has: 16 is AVX-512, 8 AVX2), GFLOP/s (2 per
    multiply-accumulate), and the probe it came from."""
    rates = measure(iterations)
    name = "fma_f32_512" if rates.get("fma_f32_512") and vector_floats >= 16 else "fma_f32_256"
    return 2 * (rates.get(name) or 0.0) * threads, name


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--iterations", type=int, default=50_000_000, help="loop trips per timed run (8 ops each)"
    )
    args = parser.parse_args()
    if args.iterations <= 0:
        parser.error("--iterations: must be > 0")
    load_before = os.getloadavg()[0]
    print("probing (each: a warm-up and the best of 3 runs) ...", file=sys.stderr, flush=True)
    rates = measure(args.iterations)
    print(
        f"\nSIMD multiply-accumulate throughput, one core; "
        f"1-min load average {load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end"
    )
    print(f"  {'arithmetic':<52} {'MACs/ns':>8}  {'vs float32 FMA':>14}")
    for name, (what, base) in PROBES.items():
        rate = rates.get(name)
        if rate is None:
            print(f"  {what:<52} {'-':>8}  {'not on this CPU':>14}")
            continue
        ratio = f"{rate / rates[base]:.2f}x" if rates.get(base) else "-"
        print(f"  {what:<52} {rate:>8.1f}  {ratio:>14}")


if __name__ == "__main__":
    main()
