"""cpu_isa's reading of CPUID and XCR0, on CPUs built from their registers."""

from __future__ import annotations

import pytest

from disagg.kernels import cpu_isa
from disagg.kernels.cpu_isa import AVX512_STATE, AVX_STATE, CpuId


def _cpu(features: set[str], xcr0: int) -> CpuId:
    registers: dict[tuple[int, int], list[int]] = {}
    for f in cpu_isa.FEATURES:
        regs = registers.setdefault((f.leaf, f.subleaf), [0, 0, 0, 0])
        if f.name in features:
            regs[f.reg] |= 1 << f.bit
    return CpuId(x86=True, registers={k: tuple(v) for k, v in registers.items()}, xcr0=xcr0)


HASWELL = set(cpu_isa.LEVELS["x86-64-v3"]) | {"sse3", "pclmul", "aes"}
SKYLAKE_X = HASWELL | set(cpu_isa.LEVELS["x86-64-v4"])


def test_an_avx2_cpu_gets_every_avx512_flag_turned_off():
    usable = _cpu(HASWELL, AVX_STATE).usable()
    assert usable == frozenset(HASWELL) and cpu_isa.level(usable) == "x86-64-v3"
    flags = cpu_isa.disable_flags(usable)
    assert {"-mno-avx512f", "-mno-avx512bw", "-mno-avx512vnni", "-mno-avxvnni", "-mno-amx-tile"} <= set(flags)
    assert "-mno-avx2" not in flags and "-mno-fma" not in flags


def test_a_feature_counts_only_where_the_os_saves_its_registers():
    """AVX-512 listed by CPUID but its ZMM state not enabled in XCR0 (and AVX without YMM state)."""
    assert cpu_isa.level(_cpu(SKYLAKE_X, AVX512_STATE).usable()) == "x86-64-v4"
    assert cpu_isa.level(_cpu(SKYLAKE_X, AVX_STATE).usable()) == "x86-64-v3"
    assert "avx2" not in _cpu(HASWELL, 0).usable() and "popcnt" in _cpu(HASWELL, 0).usable()


def test_a_level_this_cpu_cannot_run_is_refused_naming_what_it_lacks():
    usable = _cpu(HASWELL, AVX_STATE).usable()
    cpu_isa.check_level("x86-64-v3", usable)
    with pytest.raises(RuntimeError, match="avx512bw, avx512cd, avx512dq, avx512f, avx512vl"):
        cpu_isa.check_level("x86-64-v4", usable)


def test_the_brand_string_and_a_cpu_that_is_not_x86():
    name = b"AMD EPYC 7763 64-Core Processor".ljust(48, b"\0")
    words = [int.from_bytes(name[i : i + 4], "little") for i in range(0, 48, 4)]
    registers = {(0x80000000, 0): (0x80000008, 0, 0, 0)}
    registers |= {(0x80000002 + i, 0): tuple(words[4 * i : 4 * i + 4]) for i in range(3)}
    assert CpuId(x86=True, registers=registers).brand() == "AMD EPYC 7763 64-Core Processor"
    assert CpuId(x86=False).usable() == frozenset() and CpuId(x86=False).brand() == "not an x86-64 CPU"
