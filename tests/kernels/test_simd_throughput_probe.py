"""bench/simd_throughput.c builds with the C compiler and probes exactly what this CPU can run:
the bench's claim of which arithmetic an 8-bit weight can use rests on it."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "bench" / "simd_throughput.c"
# the probe's instruction-set column -> the /proc/cpuinfo flag that must be present
NEEDS = {"avx2": "avx2", "avx512f": "avx512f", "avx512_vnni": "avx512_vnni", "avx512_bf16": "avx512_bf16"}


def test_the_probe_runs_every_variant_this_cpu_has_and_no_other(tmp_path):
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 instruction sets")
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("needs a C compiler (cc)")
    subprocess.run([cc, "-O2", "-Wall", "-Werror", "-o", str(tmp_path / "probe"), str(SOURCE)], check=True)
    out = subprocess.run(
        [str(tmp_path / "probe"), "20000"], check=True, capture_output=True, text=True
    ).stdout
    flags = set(Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split())
    rows = [line.split() for line in out.splitlines()]
    assert len(rows) == 8 and all(len(r) == 3 for r in rows), out
    for name, isa, value in rows:
        assert (value != "-") == (NEEDS[isa] in flags), (name, isa, value)
        assert value == "-" or float(value) > 0, (name, value)
