/* Peak multiply-accumulate rate of one core for each arithmetic the CPU kernels can build a
 * matrix product on: float32 FMA, int16 pairs (VPMADDWD + VPADDD: AVX2's int8 path), u8 x s8
 * pairs (VPMADDUBSW: 16-bit sums that saturate; alone, and widened to 32 bits by a VPMADDWD by
 * ones as an int8 dot product must be), and AVX-512's VNNI / BF16 dot products.
 *
 * Each loop runs 8 independent accumulators (more than the latency of any of these instructions
 * needs) on register operands only, so it measures the execution units, not memory. Every
 * accumulator has its own operands: a compiler would otherwise compute a repeated product once.
 * Each variant is compiled for its own instruction set (target attributes) and runs only where
 * the CPU has it. Prints one line per variant: name, multiply-accumulates per nanosecond.
 * Built and run by bench/simd_throughput.py.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* The operands are hidden from the optimiser once per iteration (no instruction emitted). */
#define OPAQUE4(a, b, c, d) __asm__ volatile("" : "+x"(a), "+x"(b), "+x"(c), "+x"(d))

/* 8 accumulators a0..a7 over 4 operands x0..x3 and 2 more y0, y1: every pair distinct. */
#define EIGHT(STEP)                 \
    do {                            \
        a0 = STEP(a0, x0, y0);      \
        a1 = STEP(a1, x1, y0);      \
        a2 = STEP(a2, x2, y0);      \
        a3 = STEP(a3, x3, y0);      \
        a4 = STEP(a4, x0, y1);      \
        a5 = STEP(a5, x1, y1);      \
        a6 = STEP(a6, x2, y1);      \
        a7 = STEP(a7, x3, y1);      \
        OPAQUE4(x0, x1, x2, x3);    \
        __asm__ volatile("" : "+x"(y0), "+x"(y1)); \
    } while (0)

#define PROBE(NAME, TARGET, VEC, SET, STEP, MACS_PER_STEP, SINK)                      \
    __attribute__((target(TARGET))) static double NAME(long n) {                    \
        VEC a0 = SET(1), a1 = SET(2), a2 = SET(3), a3 = SET(4), a4 = SET(5), a5 = SET(6); \
        VEC a6 = SET(7), a7 = SET(8), x0 = SET(1), x1 = SET(2), x2 = SET(3), x3 = SET(1); \
        VEC y0 = SET(1), y1 = SET(1);                                                 \
        const double t = now();                                                       \
        for (long i = 0; i < n; i++) EIGHT(STEP);                                     \
        const double dt = now() - t;                                                  \
        VEC s = a0;                                                                   \
        s = SINK(s, a1); s = SINK(s, a2); s = SINK(s, a3);                            \
        s = SINK(s, a4); s = SINK(s, a5); s = SINK(s, a6); s = SINK(s, a7);           \
        volatile VEC keep = s;                                                        \
        (void)keep;                                                                   \
        return (double)n * 8 * (MACS_PER_STEP) / dt / 1e9;                            \
    }

/* ---- AVX2 + FMA: 256-bit ---- */
#define FMA256(a, x, y) _mm256_fmadd_ps(x, y, a)
PROBE(fma_f32_256, "avx2,fma", __m256, _mm256_set1_ps, FMA256, 8, _mm256_add_ps)
#define MADDWD256(a, x, y) _mm256_add_epi32(a, _mm256_madd_epi16(x, y))
PROBE(maddwd_256, "avx2", __m256i, _mm256_set1_epi16, MADDWD256, 16, _mm256_add_epi32)
#define MADDUBS256(a, x, y) _mm256_add_epi16(a, _mm256_maddubs_epi16(x, y))
PROBE(maddubs_256, "avx2", __m256i, _mm256_set1_epi8, MADDUBS256, 32, _mm256_add_epi16)
/* The usable form: the 16-bit pair sums widened to 32 bits by a second multiply (by ones). */
#define MADDUBS_WIDEN256(a, x, y) \
    _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1)))
PROBE(maddubs_widen_256, "avx2", __m256i, _mm256_set1_epi8, MADDUBS_WIDEN256, 32, _mm256_add_epi32)

/* ---- AVX-512: 512-bit ---- */
#define FMA512(a, x, y) _mm512_fmadd_ps(x, y, a)
PROBE(fma_f32_512, "avx512f", __m512, _mm512_set1_ps, FMA512, 16, _mm512_add_ps)
#define DPBUSD512(a, x, y) _mm512_dpbusd_epi32(a, x, y)
PROBE(dpbusd_512, "avx512f,avx512bw,avx512vnni", __m512i, _mm512_set1_epi8, DPBUSD512, 64, _mm512_add_epi32)
#define DPWSSD512(a, x, y) _mm512_dpwssd_epi32(a, x, y)
PROBE(dpwssd_512, "avx512f,avx512bw,avx512vnni", __m512i, _mm512_set1_epi16, DPWSSD512, 32, _mm512_add_epi32)
#define DPBF16_512(a, x, y) _mm512_dpbf16_ps(a, (__m512bh)(x), (__m512bh)(y))
PROBE(dpbf16_512, "avx512f,avx512bw,avx512bf16", __m512, _mm512_set1_ps, DPBF16_512, 32, _mm512_add_ps)

struct probe {
    const char *name, *isa;
    int supported;
    double (*run)(long);
};

int main(int argc, char **argv) {
    const long n = argc > 1 ? atol(argv[1]) : 50000000;
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    const int vnni = avx512 && __builtin_cpu_supports("avx512vnni");
    const int bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
    const struct probe probes[] = {
        {"fma_f32_256", "avx2", avx2, fma_f32_256},
        {"maddwd_i16_256", "avx2", avx2, maddwd_256},
        {"maddubs_u8s8_256", "avx2", avx2, maddubs_256},
        {"maddubs_widened_256", "avx2", avx2, maddubs_widen_256},
        {"fma_f32_512", "avx512f", avx512, fma_f32_512},
        {"dpbusd_u8s8_512", "avx512_vnni", vnni, dpbusd_512},
        {"dpwssd_i16_512", "avx512_vnni", vnni, dpwssd_512},
        {"dpbf16_bf16_512", "avx512_bf16", bf16, dpbf16_512},
    };
    for (size_t i = 0; i < sizeof probes / sizeof probes[0]; i++) {
        if (!probes[i].supported) {
            printf("%s %s -\n", probes[i].name, probes[i].isa);
            continue;
        }
        probes[i].run(n / 10); /* warm up: clocks and the vector units' power state */
        double best = 0;
        for (int r = 0; r < 3; r++) {
            const double v = probes[i].run(n);
            if (v > best) best = v;
        }
        printf("%s %s %.2f\n", probes[i].name, probes[i].isa, best);
        fflush(stdout);
    }
    return 0;
}
