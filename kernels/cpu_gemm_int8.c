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
 * Without VNNI the same integers are summed by plain loops (correct, not fast; `linear` does not
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
#endif

/* 4 x 6 = 24 accumulators, 4 weight vectors and one input vector: 29 of 32 registers. */
#define NR 4
#define MR 6
/* Weight rows a thread takes at a time (a multiple of NR): 64 x K bytes, in L2. */
#define GEMM_CHUNK 64
/* Inputs passed over a thread's weight rows at a time: 256 x K bytes, in L2 beside them. */
#define GEMM_M_BLOCK 256
/* Inputs are stored in rows of a multiple of this many bytes. */
#define K_ALIGN 64
/* The largest rounded input: int8 for VPDPBUSD; 16-bit inputs, split into two bytes. */
#define X_MAX 127.0f
#define X16_MAX 32767.0f

static int64_t padded(int64_t k) { return (k + K_ALIGN - 1) / K_ALIGN * K_ALIGN; }

/* u[i] = round(x[i] / s) + 128 for i < k, 0 beyond (to kp), s = max|x| / 127 (1 for a zero row). */
static float quantize_row_u8(const float *x, int64_t k, int64_t kp, uint8_t *u) {
    float amax = 0.0f;
    for (int64_t i = 0; i < k; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float s = amax > 0.0f ? amax / X_MAX : 1.0f;
    const float inv = 1.0f / s;
    for (int64_t i = 0; i < k; i++) u[i] = (uint8_t)((int32_t)rintf(x[i] * inv) + 128); /* nearest, ties even */
    memset(u + k, 0, (size_t)(kp - k));
    return s;
}

/* 16-bit inputs as two byte planes, q = round(x / s) = 256 hi + lo with s = max|x| / 32767:
 * hi + 128 (hi = q >> 8 in [-128, 127]) at u, lo (q & 255) at u + kp; zeros beyond k. */
static float quantize_row_planes(const float *x, int64_t k, int64_t kp, uint8_t *u) {
    float amax = 0.0f;
    for (int64_t i = 0; i < k; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float s = amax > 0.0f ? amax / X16_MAX : 1.0f;
    const float inv = 1.0f / s;
    for (int64_t i = 0; i < k; i++) {
        const int32_t q = (int32_t)rintf(x[i] * inv);
        u[i] = (uint8_t)((q >> 8) + 128);
        u[kp + i] = (uint8_t)(q & 255);
    }
    memset(u + k, 0, (size_t)(kp - k));
    memset(u + kp + k, 0, (size_t)(kp - k));
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


#else /* no VNNI: the same integers, summed by plain loops */


static void tile(const int8_t *w, int64_t k, const uint8_t *u, int64_t xs, int32_t *dots, int nr, int mr,
                 int prefetch) {
    (void)prefetch;
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) {
            int32_t s = 0;
            for (int64_t j = 0; j < k; j++) s += (int32_t)u[m * xs + j] * w[r * k + j];
            dots[m * nr + r] = s;
        }
}
#endif

/* The inputs as the tiles read them: rounded rows of `planes` byte planes of kp bytes each (one:
 * int8 + 128; two: a 16-bit value's high byte + 128, then its low byte), and their scales. */
typedef struct {
    const uint8_t *u;
    const float *scale;
    int64_t kp;
    int planes;
} inputs_u8;

/* Weight rows [r0, r1) against inputs [0, m) (y rows n apart), tiles of nearly equal size
 * (as cpu_gemm.c: 32 inputs as 6 6 5 5 5 5, not 6 6 6 6 6 2). A tile's "inputs" are byte planes:
 * MR / planes inputs at a time, their planes read as consecutive rows. */
static void block_i8(const int8_t *w, const float *scale, const int32_t *row_sums, int64_t k, inputs_u8 in,
                     float *y, int64_t n, int64_t m, int64_t r0, int64_t r1) {
    const int per_tile = MR / in.planes;
    const int64_t tiles = (m + per_tile - 1) / per_tile;
    for (int64_t r = r0; r < r1; r += NR) {
        const int nr = r1 - r < NR ? (int)(r1 - r) : NR;
        int64_t m0 = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int mr = (int)((m - m0) / (tiles - t)) + ((m - m0) % (tiles - t) ? 1 : 0);
            int32_t dots[NR * MR];
            tile(w + r * k, k, in.u + m0 * in.planes * in.kp, in.kp, dots, nr, mr * in.planes, t == 0);
            for (int i = 0; i < mr; i++)
                for (int q = 0; q < nr; q++) {
                    const int32_t *d = dots + i * in.planes * nr + q;
                    float dot = (float)(d[0] - 128 * row_sums[r + q]); /* the +128 shift taken back */
                    if (in.planes == 2) dot = dot * 256.0f + (float)d[nr];
                    y[(m0 + i) * n + r + q] = dot * (in.scale[m0 + i] * scale[r + q]);
                }
            m0 += mr;
        }
    }
}

/* Weight rows [r0, r1) against all m inputs, GEMM_M_BLOCK at a time, then their bias. */
static void rows_i8(const int8_t *w, const float *scale, const int32_t *row_sums, const float *bias, int64_t k,
                    inputs_u8 in, float *y, int64_t n, int64_t m, int64_t r0, int64_t r1) {
    const int64_t blocks = (m + GEMM_M_BLOCK - 1) / GEMM_M_BLOCK;
    for (int64_t b = 0, m0 = 0; b < blocks; b++) {
        const int64_t mb = (m - m0) / (blocks - b) + ((m - m0) % (blocks - b) ? 1 : 0);
        const inputs_u8 part = {in.u + m0 * in.planes * in.kp, in.scale + m0, in.kp, in.planes};
        block_i8(w, scale, row_sums, k, part, y + m0 * n, n, mb, r0, r1);
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
    const int64_t kp = padded(k);
    const int planes = input_bits == 16 ? 2 : 1;
    uint8_t *u = aligned_alloc(64, (size_t)(m * planes * kp + 64 * ((m * 4 + 63) / 64)));
    if (!u) return -1;
    float *sx = (float *)(u + m * planes * kp);
    const inputs_u8 in = {u, sx, kp, planes};
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++)
            sx[i] = planes == 2 ? quantize_row_planes(x + i * k, k, kp, u + i * 2 * kp)
                                : quantize_row_u8(x + i * k, k, kp, u + i * kp);
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < n; r += GEMM_CHUNK)
            rows_i8(w, scale, row_sums, bias, k, in, y, n, m, r, r + GEMM_CHUNK < n ? r + GEMM_CHUNK : n);
    }
    free(u);
    return 0;
}

/* 1 where gemm_i8 runs on VNNI (the fast path), 0 where it sums in plain loops. */
int gemm_i8_vnni(void) {
#ifdef GEMM_I8_VNNI
    return 1;
#else
    return 0;
#endif
}
