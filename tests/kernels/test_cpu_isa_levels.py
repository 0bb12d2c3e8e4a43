"""The native kernels built for each x86-64 level below this CPU's own, tested again.

A build takes one code path per kernel, by the instructions its target has: AVX-512 (VNNI,
BF16) where present, AVX2 + FMA below that, generic vector loops below that. `-march=native`
picks one, so a test run checks only this CPU's. Here the native kernel tests run again in a
child process with the kernels built (`DISAGG_CPU_NATIVE_ARCH`) for every lower level this CPU
can execute and whose code paths differ from the native build's: x86-64-v3 (AVX2, FMA, no
AVX-512) and x86-64-v2 (SSE4.2: the generic loops).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from disagg.kernels import cpu_isa, native_build

ROOT = Path(__file__).resolve().parents[2]
LEVELS = ("x86-64-v3", "x86-64-v2")
KERNEL_TESTS = [
    "tests/kernels/test_cpu_gemm.py",
    "tests/kernels/test_cpu_gemm_int8.py",
    "tests/kernels/test_cpu_decode_step.py",
    "tests/kernels/test_cpu_bf16.py",
    "tests/kernels/test_cpu_kv_quant.py",
    "tests/kernels/test_cpu_native.py",
    "tests/kernels/test_native_build.py",
    "tests/kernels/test_native_entries.py",
]


# The instructions that choose a kernel's code path (the #if's of kernels/csrc/*.c).
PATH_FLAGS = {"avx512f", "avx512bw", "avx512vnni", "avx512bf16", "avxvnni", "avx2", "fma", "f16c"}


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_native_kernel_tests_pass_when_built_for(level, tmp_path):
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 levels")
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler (cc)")
    flags = native_build.cpu_features()
    missing = cpu_isa.LEVELS[level] - flags
    if missing:
        pytest.skip(f"this CPU cannot run {level} code (no {', '.join(sorted(missing))})")
    if flags & PATH_FLAGS == cpu_isa.LEVELS[level] & PATH_FLAGS:
        pytest.skip(f"the native build takes {level}'s code paths here: the suite's own run covers them")
    env = dict(os.environ, DISAGG_CPU_NATIVE_ARCH=level, DISAGG_CACHE_DIR=str(tmp_path / "cache"))
    probe = subprocess.run(
        [sys.executable, "-c", "from disagg.kernels import cpu_native; print(cpu_native.gemm_vector_floats())"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split() == ["8"], "below AVX-512 the GEMM tiles are 8 floats wide"
    run = subprocess.run(
        # (the cache-directory tests check no code path)
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k", "not cache", *KERNEL_TESTS],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
