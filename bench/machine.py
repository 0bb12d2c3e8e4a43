"""What a benchmark says of the machine its figures came from (every quoted figure names its CPU)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "an unknown CPU"


def kernel_report() -> str:
    """The CPU as the native kernels see it: its name, the instruction sets this process may
    execute and those the kernels were built for (`DISAGG_CPU_NATIVE_ARCH` chooses another level),
    and AMX; every figure of a CPU kernel depends on them."""
    from disagg.kernels import native_build

    return native_build.cpu_report()
