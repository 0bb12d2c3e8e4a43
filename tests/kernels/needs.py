"""What a kernel test needs of the CPU, declared once: one marker per instruction set, each
skipping the test where this process may not execute it. The CPU is read as the process sees it
(CPUID in the process, `native_build.cpu_features()`), so under an emulator (`make test-isa`) the
emulated CPU counts, not the host's."""

from __future__ import annotations

import platform

import pytest

from disagg.kernels import native_build

native = pytest.mark.skipif(
    not native_build.available(), reason="needs the native kernels (a C compiler, cc)"
)
x86_64 = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 instruction sets")
amx = pytest.mark.skipif(not native_build.amx_usable(), reason="needs AMX (granted and probed)")


def has(feature: str) -> bool:
    """Whether this process may execute the instruction set of that name (cpu_isa's names)."""
    return feature in native_build.cpu_features()
