/* What the running CPU and kernel let this process execute, beyond what the compiler was told.
 *
 * AMX is listed in /proc/cpuinfo (CPUID) on hosts whose kernel or hypervisor does not let a process
 * use it: its tile state must be enabled in XCR0 by the kernel, and on Linux each process must also
 * ask for it (arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)) before its first tile instruction, or that
 * instruction dies with SIGILL. So AMX counts as usable only after all three (and the AVX-512 state
 * the GEMMs around the tiles use), and a probe (load a tile configuration, zero a tile, release)
 * that ran in a forked child and exited cleanly: a hypervisor that still traps the instructions then
 * kills the child, not this process.
 *
 * With DISAGG_NO_AMX (kernels built for an x86-64 level, native_build.py) it is never usable, as on
 * a CPU of that level. The other kernels are built with AMX turned off (native_build.py passes
 * -mno-amx-*): -march=native on a CPU that lists it must not let the compiler assume it. */
#include "cpu_kernels.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__)) && !defined(DISAGG_NO_AMX)
#include <cpuid.h>
#include <errno.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILECFG 17
#define XFEATURE_XTILEDATA 18
#define XSTATE_AVX512 0xe6 /* SSE, AVX, opmask, ZMM upper halves, ZMM16-31 */

/* Tile instructions by their encodings: the file is built with AMX off, and the probe must not depend
 * on a compiler that knows the mnemonics. */
static void amx_probe_body(void) {
    unsigned char cfg[64];
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;      /* palette 1 */
    cfg[16] = 64;    /* tile 0: 64 bytes per row */
    cfg[48] = 16;    /* tile 0: 16 rows */
    __asm__ volatile(".byte 0xc4, 0xe2, 0x78, 0x49, 0x00" ::"a"(cfg) : "memory"); /* ldtilecfg (%rax) */
    __asm__ volatile(".byte 0xc4, 0xe2, 0x7b, 0x49, 0xc0" ::: "memory");          /* tilezero %tmm0 */
    __asm__ volatile(".byte 0xc4, 0xe2, 0x78, 0x49, 0xc0" ::: "memory");          /* tilerelease */
}

static int64_t amx_state = -1; /* -1: not asked yet */

int64_t amx_usable(void) {
    if (amx_state >= 0) return amx_state;
    unsigned a, b, c, d;
    amx_state = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int tile = (d >> 24) & 1, int8 = (d >> 25) & 1, bf16 = (d >> 22) & 1;
    if (!tile || !(int8 || bf16)) return 0;
    /* cpu_amx.c's bodies also use AVX-512 F, BW, VL and BF16 around the tiles */
    const int avx512 = (b >> 16) & 1 && (b >> 30) & 1 && (b >> 31) & 1;
    if (!avx512 || !__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return 0; /* OSXSAVE: xgetbv allowed */
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    const uint64_t xcr0 = ((uint64_t)hi << 32) | lo;
    if ((xcr0 & XSTATE_AVX512) != XSTATE_AVX512) return 0;
    if (!((xcr0 >> XFEATURE_XTILECFG) & 1) || !((xcr0 >> XFEATURE_XTILEDATA) & 1)) return 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    uint64_t granted = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted) != 0) return 0;
    if (!((granted >> XFEATURE_XTILEDATA) & 1)) return 0;
    const pid_t pid = fork();
    if (pid < 0) return 0;
    if (pid == 0) {
        amx_probe_body();
        _exit(0);
    }
    int status = 0;
    pid_t done;
    while ((done = waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
    }
    if (done != pid) return 0;
    amx_state = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    return amx_state;
}
#else
int64_t amx_usable(void) { return 0; }
#endif
