/* CPUID and XGETBV for the process that loads this file: what the CPU (or the emulator or
 * hypervisor under it) lets this process execute, read in this process.
 *
 * Built apart from the kernels and for the compiler's baseline target (no -march), so that it runs
 * on any x86-64 CPU: cpu_isa.py reads it before it chooses the kernels' own compiler flags. The
 * compiler's -march=native asks the CPU from the compiler's own process, which under an emulator
 * such as qemu-user is the host's CPU, not the one the kernels will run on. */
#include <stdint.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>

/* out = eax, ebx, ecx, edx of CPUID(leaf, subleaf); zeros past the highest leaf of its range. */
void cpu_probe_cpuid(uint32_t leaf, uint32_t subleaf, uint32_t out[4]) {
    out[0] = out[1] = out[2] = out[3] = 0;
    if (__get_cpuid_max(leaf & 0x80000000u, 0) < leaf) return;
    __cpuid_count(leaf, subleaf, out[0], out[1], out[2], out[3]);
}

/* XCR0: the register state the operating system saves for this process (0 without OSXSAVE). */
uint64_t cpu_probe_xcr0(void) {
    uint32_t a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return 0;
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

int cpu_probe_x86(void) { return 1; }
#else
void cpu_probe_cpuid(uint32_t leaf, uint32_t subleaf, uint32_t out[4]) {
    (void)leaf, (void)subleaf;
    out[0] = out[1] = out[2] = out[3] = 0;
}
uint64_t cpu_probe_xcr0(void) { return 0; }
int cpu_probe_x86(void) { return 0; }
#endif
