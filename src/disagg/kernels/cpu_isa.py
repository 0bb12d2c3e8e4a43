"""Which instructions this process may execute, from CPUID and XCR0 as the process itself reads them
(`cpu_probe.c`), and the compiler flags that keep the native kernels within them.

The compiler's `-march=native` asks the CPU from the compiler's own process. Under an emulator
(`qemu-x86_64 -cpu Haswell-v4`, which runs AVX2 code and no AVX-512 on any host) or a hypervisor
that hides features from some processes, that is not the CPU the kernels run on: built for it,
they die of an illegal instruction. So every feature the compiler may use is looked up here, and
each one this process may not execute is turned off (`-mno-<name>`). A feature counts only where
the CPU lists it and the operating system saves its registers (XCR0): AVX needs the YMM state,
AVX-512 the opmask and ZMM state.

Pure logic over the raw registers: `CpuId` holds what the probe read, so tests can build any CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EAX, EBX, ECX, EDX = range(4)
# XCR0 state components beyond the SSE registers (which every x86-64 OS saves): AVX (YMM, bits 1-2),
# AVX-512 (opmask, ZMM halves, ZMM16-31: bits 5-7), AMX (tile config and data: bits 17-18).
AVX_STATE, AVX512_STATE, AMX_STATE = 0x6, 0xE6, 0x60006


@dataclass(frozen=True)
class Feature:
    name: str  # the compiler's: -m<name>, -mno-<name>
    leaf: int
    subleaf: int
    reg: int
    bit: int
    state: int = 0  # XCR0 bits the OS must have enabled


def _features() -> tuple[Feature, ...]:
    table = {
        (1, 0, ECX): {
            "sse3": (0, 0), "pclmul": (1, 0), "ssse3": (9, 0), "fma": (12, AVX_STATE),
            "sse4.1": (19, 0), "sse4.2": (20, 0), "movbe": (22, 0), "popcnt": (23, 0),
            "aes": (25, 0), "avx": (28, AVX_STATE), "f16c": (29, AVX_STATE),
        },
        (7, 0, EBX): {
            "bmi": (3, 0), "avx2": (5, AVX_STATE), "bmi2": (8, 0), "avx512f": (16, AVX512_STATE),
            "avx512dq": (17, AVX512_STATE), "adx": (19, 0), "avx512ifma": (21, AVX512_STATE),
            "avx512cd": (28, AVX512_STATE), "sha": (29, 0), "avx512bw": (30, AVX512_STATE),
            "avx512vl": (31, AVX512_STATE),
        },
        (7, 0, ECX): {
            "avx512vbmi": (1, AVX512_STATE), "avx512vbmi2": (6, AVX512_STATE), "gfni": (8, 0),
            "vaes": (9, AVX_STATE), "vpclmulqdq": (10, AVX_STATE), "avx512vnni": (11, AVX512_STATE),
            "avx512bitalg": (12, AVX512_STATE), "avx512vpopcntdq": (14, AVX512_STATE),
        },
        (7, 0, EDX): {
            "avx512vp2intersect": (8, AVX512_STATE), "amx-bf16": (22, AMX_STATE),
            "avx512fp16": (23, AVX512_STATE), "amx-tile": (24, AMX_STATE), "amx-int8": (25, AMX_STATE),
        },
        (7, 1, EAX): {"avxvnni": (4, AVX_STATE), "avx512bf16": (5, AVX512_STATE)},
        (0x80000001, 0, ECX): {"lzcnt": (5, 0), "prfchw": (8, 0)},
    }  # fmt: skip
    return tuple(
        Feature(name, leaf, subleaf, reg, bit, state)
        for (leaf, subleaf, reg), names in table.items()
        for name, (bit, state) in names.items()
    )


FEATURES = _features()
# The CPUID leaves FEATURES and `brand` read: (leaf, subleaf).
LEAVES = (
    (0, 0),
    (1, 0),
    (7, 0),
    (7, 1),
    (0x80000000, 0),
    (0x80000001, 0),
    *((0x80000002 + i, 0) for i in range(3)),
)

# The x86-64 micro-architecture levels (the psABI's): what -march=<level> lets the compiler use.
_V2 = frozenset({"ssse3", "sse4.1", "sse4.2", "popcnt"})
_V3 = _V2 | {"avx", "avx2", "bmi", "bmi2", "f16c", "fma", "lzcnt", "movbe"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
LEVELS = {"x86-64": frozenset(), "x86-64-v2": _V2, "x86-64-v3": _V3, "x86-64-v4": _V4}
# What the kernels' code paths are chosen by, as a person reads them (`describe`).
NOTABLE = {
    "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avxvnni": "AVX-VNNI", "avx512f": "AVX-512F",
    "avx512bw": "BW", "avx512vl": "VL", "avx512vnni": "VNNI", "avx512bf16": "BF16", "avx512fp16": "FP16",
    "amx-tile": "AMX-TILE", "amx-int8": "AMX-INT8", "amx-bf16": "AMX-BF16",
}  # fmt: skip


@dataclass(frozen=True)
class CpuId:
    """What CPUID (at `LEAVES`) and XGETBV answered one process; `x86` False elsewhere."""

    x86: bool
    registers: dict[tuple[int, int], tuple[int, int, int, int]] = field(default_factory=dict)
    xcr0: int = 0

    def has(self, feature: Feature) -> bool:
        regs = self.registers.get((feature.leaf, feature.subleaf), (0, 0, 0, 0))
        return bool((regs[feature.reg] >> feature.bit) & 1) and (self.xcr0 & feature.state) == feature.state

    def usable(self) -> frozenset[str]:
        """The compiler names of every feature this process may execute."""
        return frozenset(f.name for f in FEATURES if self.has(f)) if self.x86 else frozenset()

    def brand(self) -> str:
        """The processor's name as CPUID gives it (e.g. "AMD EPYC 7763 64-Core Processor")."""
        if self.registers.get((0x80000000, 0), (0,))[0] < 0x80000004:
            return "unknown x86-64 CPU" if self.x86 else "not an x86-64 CPU"
        raw = b"".join(
            r.to_bytes(4, "little") for i in range(3) for r in self.registers[(0x80000002 + i, 0)]
        )  # fmt: skip
        return raw.split(b"\0", 1)[0].decode("ascii", "replace").strip()


def disable_flags(usable: frozenset[str]) -> list[str]:
    """-mno-<name> for every feature this process may not execute: with -march=native, the
    kernels then use only what the running CPU allows, whatever the compiler's process saw."""
    return [f"-mno-{f.name}" for f in FEATURES if f.name not in usable]


def check_level(target: str, usable: frozenset[str]) -> None:
    """Refuse a named x86-64 level (DISAGG_CPU_NATIVE_ARCH) that this process cannot execute."""
    missing = LEVELS.get(target, frozenset()) - usable
    if missing:
        raise RuntimeError(
            f"kernels built for {target} would need {', '.join(sorted(missing))}, which this CPU "
            "(as this process sees it) does not offer"
        )


def level(usable: frozenset[str]) -> str:
    """The highest x86-64 level whose instructions are all usable."""
    return max((name for name, needs in LEVELS.items() if needs <= usable), key=lambda n: len(LEVELS[n]))


def describe(usable: frozenset[str]) -> str:
    """The level and the notable extensions, e.g. "x86-64-v3 AVX2 FMA F16C"."""
    return " ".join([level(usable), *(label for name, label in NOTABLE.items() if name in usable)])
