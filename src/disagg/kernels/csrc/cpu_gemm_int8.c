/* Matrix products with int8 weights of a few to a thousand rows (decode steps of many sequences,
 * prefill chunks): y[m][n] = scale[n] * (x[m] . W[n]) (+ bias[n]), W [N][K] int8 row-major with
 * one symmetric scale per row, the same bytes the int8 GEMV reads (no second copy, no packing).
 *
 * W8A8 with dynamic per-token activation scales: each input row is rounded once per call to
 * int8, sx[m] = max|x[m]| / 127, and every dot product is integer. With AVX-512 VNNI one
 * VPDPBUSD multiplies 64 unsigned bytes by 64 signed bytes and adds them in fours into 16 int32
 * lanes: 64 multiply-adds per instruction, four times a float32 FMA's 16. VPDPBUSD wants one
 * operand unsigned, so the inputs are stored shifted, u = q + 128, and the shift is taken back
 * per output with the weight row's sum: x . w = u . w - 128 * sum(w), the sums computed once at
 * load (`QuantizedWeight.row_sums`).
 * Why W8A8 on VPDPBUSD: against W8A16 on VPDPWSSD (inputs rounded to int16 as the GEMV rounds
 * them, weights widened to int16 in registers: 32 multiply-adds per instruction plus a widening
 * per weight vector), measured with bench/small_gemm.py --int8 (one thread, weights in cache,
 * the small preset's shapes, 8-256 rows, under a load of 6 from elsewhere: ratios to the float32
 * GEMM in the same loop): W8A8 2.3-4.8x, W8A16 1.0-2.0x (the VPDPWSSD variant, since removed).
 * 16-bit inputs are still needed where the per-token int8 grid is too coarse (heavy-tailed
 * inputs: the MLP's down projection): input_bits=16 rounds a row to 16 bits (max|x| / 32767) and
 * stores it as two byte planes, q = 256 hi + lo, read by the same tiles as two rows (hi + 128,
 * unsigned lo): two VPDPBUSD per 64 products, 1.4-1.9x the float32 GEMM (VPDPWSSD's 1.0-2.0x
 * without its own loop).
 * The loop is cpu_gemm.c's: a tile of NR weight rows by up to MR input rows keeps NR * MR
 * accumulators in registers; per 64 bytes of K it loads NR weight vectors and MR input vectors
 * for NR * MR VPDPBUSD. The inputs are stored with rows padded to a multiple of 64 bytes (zeros),
 * so only the weights' last step is a masked load. Both operands run along K (dot-product form),
 * so each accumulator is summed across its lanes once, at the end, in int32: exact while
 * K * 255 * 127 < 2^31 (K up to 66K).
 * With AVX-VNNI (VEX-coded VPDPBUSD on 256-bit vectors, Intel client chips from Alder Lake) the
 * same inputs and loop run on 16 registers: tiles of 2 weight rows by 6 inputs, 32 bytes of K a step.
 * With AVX2 alone (Zen 2/3, older Intel) products go through VPMADDUBSW, which multiplies unsigned
 * by signed bytes and saturates each 16-bit sum of two products: the shifted inputs (up to 255 x
 * 127, twice) would saturate. So the inputs are stored signed, each row followed by its
 * magnitudes, and a product is |x| * (w with x's sign) (VPSIGNB): at most 128 x 127 twice, exact.
 * VPMADDWD with ones then adds the 16-bit pairs into int32 lanes: four instructions per 32
 * products (AVX-512 VNNI: one per 64), the same integers. Low byte planes are stored as lo - 128
 * (signed like the rest), taken back with the row sums as the +128 shift is. The one weight VPSIGNB
 * cannot negate is -128 (the quantizer writes [-127, 127]): a chunk of rows holding one is summed
 * by the plain loops. Tiles of 4 weight rows by 2 inputs: 8 accumulators, 2 inputs and their
 * magnitudes, a weight vector, a product and the ones, 15 of 16 registers.
 * Without AVX2 the same integers are summed by plain loops (correct, not fast; `linear` does not
 * choose this kernel there).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define GEMM_I8_VNNI 1
#elif defined(__AVXVNNI__) && defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#define GEMM_I8_AVXVNNI 1
#elif defined(__AVX2__) && !defined(__AVX512F__)
/* (AVX-512 without VNNI keeps the plain loops: its plans take torch's GEMM instead) */
#include <immintrin.h>
#define GEMM_I8_AVX2 1
#endif

#if defined(GEMM_I8_AVXVNNI)
/* 2 x 6 = 12 accumulators, 2 weight vectors and one input vector: 15 of 16 registers. */
#define NR 2
#define MR 6
#elif defined(GEMM_I8_AVX2)
#define NR 4
#define MR 2
#else
/* 4 x 6 = 24 accumulators, 4 weight vectors and one input vector: 29 of 32 registers. */
#define NR 4
#define MR 6
#endif
/* How an input byte is stored: the value plus HI_SHIFT (int8 inputs, high planes) or LO_SHIFT (low
 * planes, 0..255); X_COPIES 2: each row followed by the magnitudes of its (signed) bytes. */
#ifdef GEMM_I8_AVX2
#define X_COPIES 2
#define HI_SHIFT 0
#define LO_SHIFT (-128)
#else
#define X_COPIES 1
#define HI_SHIFT 128
#define LO_SHIFT 0
#endif
/* Weight rows a thread takes at a time (a multiple of NR): 64 x K bytes, in L2. */
#define GEMM_CHUNK 64
/* Inputs passed over a thread's weight rows at a time: 256 x K bytes, in L2 beside them. */
#define GEMM_M_BLOCK (256 / X_COPIES)
/* Inputs are stored in rows of a multiple of this many bytes. */
#define K_ALIGN 64
/* The largest rounded input: int8 for VPDPBUSD; 16-bit inputs, split into two bytes. */
#define X_MAX 127.0f
#define X16_MAX 32767.0f

static int64_t padded(int64_t k) { return (k + K_ALIGN - 1) / K_ALIGN * K_ALIGN; }

/* 1 / s with s = max|x| / x_max (1 for a zero row), and s: every path rounds alike. */
static float row_scale(const float *x, int64_t k, float x_max, float *inv) {
    float amax = 0.0f;
    for (int64_t i = 0; i < k; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float s = amax > 0.0f ? amax / x_max : 1.0f;
    *inv = 1.0f / s;
    return s;
}

/* Byte i of a stored row (kp bytes; with X_COPIES 2 its magnitude kp bytes after). */
static inline void put(uint8_t *u, int64_t kp, int64_t i, int32_t v) {
    u[i] = (uint8_t)v;
    if (X_COPIES == 2) u[kp + i] = (uint8_t)abs((int8_t)v);
}

/* Zeros from byte k to kp of a stored row and of its magnitudes. */
static void pad_row(uint8_t *u, int64_t k, int64_t kp) {
    for (int c = 0; c < X_COPIES; c++) memset(u + c * kp + k, 0, (size_t)(kp - k));
}

/* u[i] = round(x[i] / s) + HI_SHIFT for i < k, 0 beyond (to kp), s = max|x| / 127. */
static float quantize_row_u8(const float *x, int64_t k, int64_t kp, uint8_t *u) {
    float inv;
    const float s = row_scale(x, k, X_MAX, &inv);
    for (int64_t i = 0; i < k; i++) put(u, kp, i, (int32_t)rintf(x[i] * inv) + HI_SHIFT); /* nearest, ties even */
    pad_row(u, k, kp);
    return s;
}

/* 16-bit inputs as two byte planes, q = round(x / s) = 256 hi + lo with s = max|x| / 32767:
 * hi + HI_SHIFT (hi = q >> 8 in [-128, 127]) at u, lo + LO_SHIFT (lo = q & 255) one stored row
 * (X_COPIES * kp bytes) after; zeros beyond k. */
static float quantize_row_planes(const float *x, int64_t k, int64_t kp, uint8_t *u) {
    float inv;
    const float s = row_scale(x, k, X16_MAX, &inv);
    uint8_t *lo = u + X_COPIES * kp;
    for (int64_t i = 0; i < k; i++) {
        const int32_t q = (int32_t)rintf(x[i] * inv);
        put(u, kp, i, (q >> 8) + HI_SHIFT);
        put(lo, kp, i, (q & 255) + LO_SHIFT);
    }
    pad_row(u, k, kp);
    pad_row(lo, k, kp);
    return s;
}

#ifdef GEMM_I8_VNNI
/* Keeps a loaded vector in a register (GCC would otherwise fold the load into each use). */
#define IN_REGISTER(v) __asm__("" : "+v"(v))
/* acc += the products of x (unsigned bytes) and w (signed bytes), in place: through the intrinsic
 * GCC copies every accumulator to another register and back around each instruction (the
 * destination is also a source), twice the instructions of the loop. */
#define DPBUSD(acc, x, w) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w))

typedef int32_t v16i __attribute__((vector_size(64)));
typedef int32_t v16iu __attribute__((vector_size(64), aligned(4)));

/* Lane sums of 16 int32 vectors, out[i] = sum of a[i], in 15 steps of two shuffles and one add
 * (as cpu_gemm.c's sum_lanes16): 16 -> 8 -> 4 -> 2 -> 1 lanes per input. */
#define HALVES(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))
static inline void sum_lanes16_i32(const v16i *a, int32_t *out) {
    v16i h8[8], h4[4], h2[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        h8[i] = HALVES(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                HALVES(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        h4[i] = HALVES(h8[2 * i], h8[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                HALVES(h8[2 * i], h8[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
        h2[i] = HALVES(h4[2 * i], h4[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                HALVES(h4[2 * i], h4[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    *(v16iu *)out = HALVES(h2[0], h2[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
                    HALVES(h2[0], h2[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* dots[m * NR + r] = u[m] . w[r] for nr weight rows (k bytes each, consecutive) and mr inputs (xs
 * bytes apart, padded with zeros to a multiple of 64); nr <= NR, mr <= MR, constant per call
 * site. With `prefetch` the next nr rows are fetched into L2 meanwhile. */
static inline __attribute__((always_inline)) void tile_u8s8(const int8_t *w, int64_t k, const uint8_t *u,
                                                            int64_t xs, int32_t *dots, const int nr,
                                                            const int mr, int prefetch) {
    __m512i acc[NR][MR];
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 6
        for (int m = 0; m < mr; m++) acc[r][m] = _mm512_setzero_si512();
    int64_t j = 0;
    for (; j < k; j += 64) {
        __m512i wv[NR];
        if (j + 64 <= k) {
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) {
                wv[r] = _mm512_loadu_si512(w + r * k + j);
                IN_REGISTER(wv[r]);
            }
        } else { /* the last, partial step: the inputs are zero there, the weights must be finite */
            const __mmask64 mask = ~0ULL >> (64 - (k - j));
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) wv[r] = _mm512_maskz_loadu_epi8(mask, w + r * k + j);
        }
        if (prefetch)
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) __builtin_prefetch(w + (nr + r) * k + j, 0, 2);
#pragma GCC unroll 6
        for (int m = 0; m < mr; m++) {
            const __m512i xv = _mm512_load_si512(u + m * xs + j);
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) DPBUSD(acc[r][m], xv, wv[r]);
        }
    }
    v16i flat[2 * 16];
#pragma GCC unroll 32
    for (int i = 0; i < 2 * 16; i++) flat[i] = i < nr * mr ? (v16i)acc[i % nr][i / nr] : (v16i){0};
    int32_t sums[2 * 16];
    sum_lanes16_i32(flat, sums);
    if (nr * mr > 16) sum_lanes16_i32(flat + 16, sums + 16);
    /* flat[i] is row i % nr, input i / nr: sums are input-major already */
    memcpy(dots, sums, sizeof(int32_t) * nr * mr);
}

#define TILE_MR(w, k, u, xs, d, nr, mr, pf)                \
    switch (mr) {                                          \
        case 1: tile_u8s8(w, k, u, xs, d, nr, 1, pf); break; \
        case 2: tile_u8s8(w, k, u, xs, d, nr, 2, pf); break; \
        case 3: tile_u8s8(w, k, u, xs, d, nr, 3, pf); break; \
        case 4: tile_u8s8(w, k, u, xs, d, nr, 4, pf); break; \
        case 5: tile_u8s8(w, k, u, xs, d, nr, 5, pf); break; \
        default: tile_u8s8(w, k, u, xs, d, nr, 6, pf); break; \
    }

static void tile(const int8_t *w, int64_t k, const uint8_t *u, int64_t xs, int32_t *dots, int nr, int mr,
                 int prefetch) {
    switch (nr) {
        case 1: TILE_MR(w, k, u, xs, dots, 1, mr, prefetch) break;
        case 2: TILE_MR(w, k, u, xs, dots, 2, mr, prefetch) break;
        case 3: TILE_MR(w, k, u, xs, dots, 3, mr, prefetch) break;
        default: TILE_MR(w, k, u, xs, dots, 4, mr, prefetch) break;
    }
}


#elif defined(GEMM_I8_AVXVNNI) || defined(GEMM_I8_AVX2)

#ifdef GEMM_I8_AVXVNNI
/* acc += x . w in place, as DPBUSD; {vex}: the AVX-VNNI encoding, not AVX-512's. */
#define DPBUSD_VEX(acc, x, w) __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(x), "x"(w))

/* acc[r][m] += u[m] . w[r] over 32 bytes: nr weight rows ws bytes apart, mr inputs xs apart. */
static inline __attribute__((always_inline)) void step32(__m256i acc[NR][MR], const int8_t *w, int64_t ws,
                                                         const uint8_t *u, int64_t xs, const int nr,
                                                         const int mr) {
    __m256i wv[NR];
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++) wv[r] = _mm256_loadu_si256((const __m256i *)(w + r * ws));
#pragma GCC unroll 6
    for (int m = 0; m < mr; m++) {
        const __m256i xv = _mm256_load_si256((const __m256i *)(u + m * xs));
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) DPBUSD_VEX(acc[r][m], xv, wv[r]);
    }
}
#else
/* acc += |x| * (w with x's sign) (VPMADDUBSW: 16-bit sums of two, at most 2 x 128 x 127), the
 * pairs added into int32 lanes (VPMADDWD with ones), t a scratch register; in place: through the
 * intrinsics GCC copies accumulators between registers and reorders the adds (a fifth slower). */
#define MADD_SIGNED(acc, w, x, mag, ones, t)                                                         \
    __asm__("vpsignb %[xv], %[wv], %[tv]\n\tvpmaddubsw %[tv], %[mv], %[tv]\n\t"                     \
            "vpmaddwd %[ov], %[tv], %[tv]\n\tvpaddd %[tv], %[av], %[av]"                             \
            : [av] "+x"(acc), [tv] "=&x"(t)                                                          \
            : [wv] "x"(w), [xv] "x"(x), [mv] "x"(mag), [ov] "x"(ones))

/* The same with signed inputs, their magnitudes xs / 2 bytes after each. */
static inline __attribute__((always_inline)) void step32(__m256i acc[NR][MR], const int8_t *w, int64_t ws,
                                                         const uint8_t *u, int64_t xs, const int nr,
                                                         const int mr) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i xv[MR], mag[MR];
#pragma GCC unroll 6
    for (int m = 0; m < mr; m++) {
        xv[m] = _mm256_load_si256((const __m256i *)(u + m * xs));
        mag[m] = _mm256_load_si256((const __m256i *)(u + m * xs + xs / 2));
    }
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + r * ws));
#pragma GCC unroll 6
        for (int m = 0; m < mr; m++) {
            __m256i t;
            MADD_SIGNED(acc[r][m], wv, xv[m], mag[m], ones, t);
        }
    }
}
#endif

/* The lane sums of a, b, c and d. */
static inline __m128i sum_lanes4(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

/* As the AVX-512 tile_u8s8, 32 bytes of K a step. AVX2 has no masked byte loads: the last, partial
 * step reads the weights from a zero-padded copy (a load past a row's end could leave the matrix). */
static inline __attribute__((always_inline)) void tile_ymm(const int8_t *w, int64_t k, const uint8_t *u,
                                                           int64_t xs, int32_t *dots, const int nr,
                                                           const int mr, int prefetch) {
    __m256i acc[NR][MR];
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 6
        for (int m = 0; m < mr; m++) acc[r][m] = _mm256_setzero_si256();
    /* without a branch in the loop (GCC then copies the accumulators around it): the rows after
     * these, or these again (in L1 already) */
    const int8_t *next = w + (prefetch ? nr * k : 0);
    int64_t j = 0;
    for (; j + 64 <= k; j += 64) {
        step32(acc, w + j, k, u + j, xs, nr, mr);
        step32(acc, w + j + 32, k, u + j + 32, xs, nr, mr);
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) __builtin_prefetch(next + r * k + j, 0, 2);
    }
    if (j + 32 <= k) {
        step32(acc, w + j, k, u + j, xs, nr, mr);
        j += 32;
    }
    if (j < k) {
        int8_t tail[NR][32] __attribute__((aligned(32)));
        memset(tail, 0, sizeof(tail));
        for (int r = 0; r < nr; r++) memcpy(tail[r], w + r * k + j, (size_t)(k - j));
        step32(acc, &tail[0][0], 32, u + j, xs, nr, mr);
    }
    enum { GROUPS = (NR * MR + 3) / 4 };
    __m256i flat[4 * GROUPS];
#pragma GCC unroll 12
    for (int i = 0; i < 4 * GROUPS; i++) flat[i] = i < nr * mr ? acc[i % nr][i / nr] : _mm256_setzero_si256();
    int32_t sums[4 * GROUPS];
#pragma GCC unroll 3
    for (int g = 0; g < GROUPS; g++)
        if (4 * g < nr * mr)
            _mm_storeu_si128((__m128i *)(sums + 4 * g),
                             sum_lanes4(flat[4 * g], flat[4 * g + 1], flat[4 * g + 2], flat[4 * g + 3]));
    /* flat[i] is row i % nr, input i / nr: sums are input-major already */
    memcpy(dots, sums, sizeof(int32_t) * nr * mr);
}

#define MIN_(a, b) ((a) < (b) ? (a) : (b))
#define TILE_YMM_MR(w, k, u, xs, d, nr, mr, pf)                           \
    switch (mr) {                                                         \
        case 1: tile_ymm(w, k, u, xs, d, nr, 1, pf); break;               \
        case 2: tile_ymm(w, k, u, xs, d, nr, MIN_(2, MR), pf); break;     \
        case 3: tile_ymm(w, k, u, xs, d, nr, MIN_(3, MR), pf); break;     \
        case 4: tile_ymm(w, k, u, xs, d, nr, MIN_(4, MR), pf); break;     \
        case 5: tile_ymm(w, k, u, xs, d, nr, MIN_(5, MR), pf); break;     \
        default: tile_ymm(w, k, u, xs, d, nr, MR, pf); break;             \
    }

static void tile(const int8_t *w, int64_t k, const uint8_t *u, int64_t xs, int32_t *dots, int nr, int mr,
                 int prefetch) {
    switch (nr) {
        case 1: TILE_YMM_MR(w, k, u, xs, dots, 1, mr, prefetch) break;
        case 2: TILE_YMM_MR(w, k, u, xs, dots, MIN_(2, NR), mr, prefetch) break;
        case 3: TILE_YMM_MR(w, k, u, xs, dots, MIN_(3, NR), mr, prefetch) break;
        default: TILE_YMM_MR(w, k, u, xs, dots, NR, mr, prefetch) break;
    }
}
#endif

#if !defined(GEMM_I8_VNNI) && !defined(GEMM_I8_AVXVNNI)
/* The same integers by plain loops: where no vector path is built, and on AVX2 for weight rows
 * holding a -128. */
static void tile_loops(const int8_t *w, int64_t k, const uint8_t *u, int64_t xs, int32_t *dots, int nr,
                       int mr) {
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) {
            int32_t s = 0;
            for (int64_t j = 0; j < k; j++)
                s += (HI_SHIFT ? (int32_t)u[m * xs + j] : (int32_t)(int8_t)u[m * xs + j]) * w[r * k + j];
            dots[m * nr + r] = s;
        }
}

#ifndef GEMM_I8_AVX2
static void tile(const int8_t *w, int64_t k, const uint8_t *u, int64_t xs, int32_t *dots, int nr, int mr,
                 int prefetch) {
    (void)prefetch;
    tile_loops(w, k, u, xs, dots, nr, mr);
}
#else
/* Whether n bytes of weights hold a -128 (which VPSIGNB cannot negate). */
static int holds_int8_min(const int8_t *w, int64_t n) {
    const __m256i min = _mm256_set1_epi8(-128);
    __m256i any = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        any = _mm256_or_si256(any, _mm256_cmpeq_epi8(_mm256_loadu_si256((const __m256i *)(w + i)), min));
    int found = !_mm256_testz_si256(any, any);
    for (; i < n; i++) found |= w[i] == -128;
    return found;
}
#endif
#endif

/* The inputs as the tiles read them: rounded rows of `planes` byte planes, each stored in xs
 * bytes (one: int8 + HI_SHIFT; two: a 16-bit value's high byte + HI_SHIFT, then its low byte +
 * LO_SHIFT; with X_COPIES 2 each followed by its magnitudes), and their scales. */
typedef struct {
    const uint8_t *u;
    const float *scale;
    int64_t xs;
    int planes;
} inputs_u8;

/* A tile's outputs y[i][q] (rows n apart) from its dots, for nr weight rows and mr inputs. */
static inline __attribute__((always_inline)) void finish(const int32_t *dots, int planes, const int nr, int mr,
                                                         const int32_t *row_sums, const float *scale,
                                                         const float *sx, float *y, int64_t n) {
    for (int i = 0; i < mr; i++)
        for (int q = 0; q < nr; q++) {
            const int32_t *d = dots + i * planes * nr + q;
            float dot = (float)(d[0] - HI_SHIFT * row_sums[q]); /* the shifts taken back */
            if (planes == 2) dot = dot * 256.0f + (float)(d[nr] - LO_SHIFT * row_sums[q]);
            y[i * n + q] = dot * (sx[i] * scale[q]);
        }
}

/* Weight rows [r0, r1) against inputs [0, m) (y rows n apart), tiles of nearly equal size
 * (as cpu_gemm.c: 32 inputs as 6 6 5 5 5 5, not 6 6 6 6 6 2). A tile's "inputs" are byte planes:
 * MR / planes inputs at a time, their planes read as consecutive rows. `loops`: the plain loops. */
static void block_i8(const int8_t *w, const float *scale, const int32_t *row_sums, int64_t k, inputs_u8 in,
                     float *y, int64_t n, int64_t m, int64_t r0, int64_t r1, int loops) {
    const int per_tile = MR / in.planes;
    const int64_t tiles = (m + per_tile - 1) / per_tile;
    for (int64_t r = r0; r < r1; r += NR) {
        const int nr = r1 - r < NR ? (int)(r1 - r) : NR;
        int64_t m0 = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int mr = (int)((m - m0) / (tiles - t)) + ((m - m0) % (tiles - t) ? 1 : 0);
            int32_t dots[NR * MR];
            const uint8_t *u = in.u + m0 * in.planes * in.xs;
#ifdef GEMM_I8_AVX2
            if (loops)
                tile_loops(w + r * k, k, u, in.xs, dots, nr, mr * in.planes);
            else
#endif
                tile(w + r * k, k, u, in.xs, dots, nr, mr * in.planes, t == 0);
            if (nr == NR) /* a constant row count: the outputs in vectors */
                finish(dots, in.planes, NR, mr, row_sums + r, scale + r, in.scale + m0, y + m0 * n + r, n);
            else
                finish(dots, in.planes, nr, mr, row_sums + r, scale + r, in.scale + m0, y + m0 * n + r, n);
            m0 += mr;
        }
    }
    (void)loops;
}

/* Weight rows [r0, r1) against all m inputs, GEMM_M_BLOCK at a time, then their bias. */
static void rows_i8(const int8_t *w, const float *scale, const int32_t *row_sums, const float *bias, int64_t k,
                    inputs_u8 in, float *y, int64_t n, int64_t m, int64_t r0, int64_t r1) {
#ifdef GEMM_I8_AVX2
    const int loops = holds_int8_min(w + r0 * k, (r1 - r0) * k);
#else
    const int loops = 0;
#endif
    const int64_t blocks = (m + GEMM_M_BLOCK - 1) / GEMM_M_BLOCK;
    for (int64_t b = 0, m0 = 0; b < blocks; b++) {
        const int64_t mb = (m - m0) / (blocks - b) + ((m - m0) % (blocks - b) ? 1 : 0);
        const inputs_u8 part = {in.u + m0 * in.planes * in.xs, in.scale + m0, in.xs, in.planes};
        block_i8(w, scale, row_sums, k, part, y + m0 * n, n, mb, r0, r1, loops);
        m0 += mb;
    }
    if (bias)
        for (int64_t i = 0; i < m; i++)
            for (int64_t r = r0; r < r1; r++) y[i * n + r] += bias[r];
}

/* y [m][n] = (x [m][k] rounded per row) W^T * scale (+ bias) over num_threads threads; row_sums[n]
 * = sum of W[n]. input_bits 8: W8A8; 16: each row to 16 bits as two byte planes (twice the
 * instructions; for heavy-tailed inputs). Returns -1 when out of memory for the rounded inputs. */
int gemm_i8(const int8_t *w, const float *scale, const int32_t *row_sums, const float *bias, const float *x,
            float *y, int64_t m, int64_t n, int64_t k, int64_t input_bits, int64_t num_threads) {
    const int64_t kp = padded(k), xs = X_COPIES * kp;
    const int planes = input_bits == 16 ? 2 : 1;
    uint8_t *u = aligned_alloc(64, (size_t)(m * planes * xs + 64 * ((m * 4 + 63) / 64)));
    if (!u) return -1;
    float *sx = (float *)(u + m * planes * xs);
    const inputs_u8 in = {u, sx, xs, planes};
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++)
            sx[i] = planes == 2 ? quantize_row_planes(x + i * k, k, kp, u + i * 2 * xs)
                                : quantize_row_u8(x + i * k, k, kp, u + i * xs);
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < n; r += GEMM_CHUNK)
            rows_i8(w, scale, row_sums, bias, k, in, y, n, m, r, r + GEMM_CHUNK < n ? r + GEMM_CHUNK : n);
    }
    free(u);
    return 0;
}

/* 1 where gemm_i8 runs a vector path (AVX-512 VNNI, AVX-VNNI or AVX2), 0 where it sums in plain loops. */
int gemm_i8_vnni(void) {
#if defined(GEMM_I8_VNNI) || defined(GEMM_I8_AVXVNNI) || defined(GEMM_I8_AVX2)
    return 1;
#else
    return 0;
#endif
}
