/* Matrix products of a few to a thousand rows (decode steps of many sequences, prefill chunks):
 * y[m][n] = x[m] . W[n] (+ bias[n]), W [N][K] row-major as torch's Linear stores it, x [M][K].
 *
 * At tens of rows each weight float meets many inputs, so the loop is shaped for arithmetic, not
 * for reading W (that is cpu_gemv.c): a tile of NR weight rows by up to MR input rows keeps
 * NR * MR accumulators of VL lanes in registers and, per VL floats of K, loads NR + MR vectors
 * for NR * MR fused multiply-adds. The tile's weight rows (NR * K floats) stay in L1 while every
 * group of inputs passes over them; the inputs stay in L2 (GEMM_M_BLOCK rows at a time). Both
 * operands run along K (dot-product form), so each accumulator is summed across its lanes once,
 * at the end. Threads take GEMM_CHUNK weight rows at a time, as the GEMV does.
 */
#include "cpu_kernels.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* The register file decides the tile. AVX-512: 32 registers of 16 floats, a tile of 4 weight rows by
 * 6 inputs (24 accumulators, 4 weight vectors and one input vector: 29 registers). Elsewhere (AVX2:
 * 16 registers of 8 floats) 4 by 3 (12 + 4 + 1 = 17: the compiler keeps one weight vector as a
 * memory operand); the AVX-512 tile on AVX2 spills every accumulator and ran at 8-14 GFLOP/s
 * against torch's 40-110 (bench/small_gemm.py, 64-1024 rows, Zen 3). */
#if defined(__x86_64__) && defined(__AVX512F__)
#define VL 16
#define NR 4
#define MR 6
/* Inputs passed over a thread's weight rows at a time: 256 x 768 floats (768 KiB) at a width of
 * 768, in the L2 beside the thread's GEMM_CHUNK weight rows. */
#define GEMM_M_BLOCK 256
#else
#define VL 8
#define NR 4
#define MR 3
#define GEMM_M_BLOCK 128 /* L2s of 256-512 KiB are common on such CPUs */
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4))); /* unaligned loads */

/* Weight rows a thread takes at a time (a multiple of NR). */
#define GEMM_CHUNK 64
/* The next tile's weight rows are prefetched into L2 (locality 2; into L1 measured slower). */
#define PREFETCH_LOCALITY 2

static inline vf loadv(const float *p) { return *(const vfu *)p; }

/* Keeps a loaded vector in a register: without it GCC folds the load into each of the NR
 * multiply-adds that use it (NR loads instead of one, and the loop bound by its loads). */
#if defined(__x86_64__) && (defined(__AVX512F__) || defined(__AVX2__)) /* a vector is one register */
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define IN_REGISTER(v) (void)(v)
#endif

/* The last `n` (< VL) floats at p, zero-padded to a vector. */
static inline vf load_tail(const float *p, int64_t n) {
    vf v = {0};
    memcpy(&v, p, (size_t)n * sizeof(float));
    return v;
}

/* bf16 weights (for CPUs that cannot multiply bf16 themselves) are widened to float32 in
 * registers, exactly: a bf16 is the top half of a float32. */
typedef uint16_t vh __attribute__((vector_size(VL * 2), aligned(2)));
typedef uint32_t vw __attribute__((vector_size(VL * 4)));

static inline vf widen_bf16(const uint16_t *p) { return (vf)(__builtin_convertvector(*(const vh *)p, vw) << 16); }

static inline vf widen_bf16_tail(const uint16_t *p, int64_t n) {
    uint16_t h[VL] = {0};
    memcpy(h, p, (size_t)n * sizeof(uint16_t));
    return widen_bf16(h);
}

/* Weight element i of a float32 (wbf16 0) or bf16 (1) matrix, and the vectors that start there. */
static inline const void *w_at(const void *w, int64_t i, const int wbf16) {
    return (const char *)w + i * (wbf16 ? 2 : 4);
}
static inline vf load_w(const void *w, int64_t i, const int wbf16) {
    return wbf16 ? widen_bf16((const uint16_t *)w + i) : loadv((const float *)w + i);
}
static inline vf load_w_tail(const void *w, int64_t i, int64_t n, const int wbf16) {
    return wbf16 ? widen_bf16_tail((const uint16_t *)w + i, n) : load_tail((const float *)w + i, n);
}

/* Weights and inputs are read the same way: float32, or bf16 widened. */
#define load_x load_w
#define load_x_tail load_w_tail

/* Lane sums of VL vectors, out[i] = sum of a[i], in 15 steps of two shuffles and one add (summing
 * each vector on its own takes about ten operations per vector). Each step halves the lanes a
 * vector keeps per input and doubles the inputs a vector holds: 16 -> 8 -> 4 -> 2 -> 1 lanes. */
#define HALVES(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))
#if VL == 16
static inline void sum_lanes(const vf *a, float *out) {
    vf h8[8], h4[4], h2[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) /* [a(2i): 8 partial sums, a(2i+1): 8] */
        h8[i] = HALVES(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                HALVES(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) /* [a(4i): 4, a(4i+1): 4, a(4i+2): 4, a(4i+3): 4] */
        h4[i] = HALVES(h8[2 * i], h8[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                HALVES(h8[2 * i], h8[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) /* [a(8i): 2, ..., a(8i+7): 2] */
        h2[i] = HALVES(h4[2 * i], h4[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                HALVES(h4[2 * i], h4[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    *(vfu *)out = HALVES(h2[0], h2[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
                   HALVES(h2[0], h2[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
/* The same for 8 vectors of 8 lanes: 8 -> 4 -> 2 -> 1 lanes per input. */
static inline void sum_lanes(const vf *a, float *out) {
    vf h4[4], h2[2];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) /* [a(2i): 4 partial sums, a(2i+1): 4] */
        h4[i] = HALVES(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
                HALVES(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) /* [a(4i): 2, ..., a(4i+3): 2] */
        h2[i] = HALVES(h4[2 * i], h4[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
                HALVES(h4[2 * i], h4[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    *(vfu *)out = HALVES(h2[0], h2[1], 0, 2, 4, 6, 8, 10, 12, 14) + HALVES(h2[0], h2[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

/* y[m * ys + r] = w[r] . x[m] for nr weight rows (k values each, consecutive; float32, or bf16 when
 * wbf16) and mr inputs (xs values apart; float32, or bf16 when xbf16); nr <= NR, mr <= MR, wbf16
 * and xbf16 constant at each call site. With `prefetch`, the next nr rows (the values after these)
 * are fetched into L2 meanwhile, one cache line per row and step. */
static inline __attribute__((always_inline)) void gemm_tile(const void *w, const int wbf16, int64_t k,
                                                            const void *x, const int xbf16, int64_t xs, float *y,
                                                            int64_t ys, const int nr, const int mr, int prefetch) {
    vf acc[NR][MR];
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 6
        for (int m = 0; m < mr; m++) acc[r][m] = (vf){0};
    int64_t j = 0;
    for (; j + VL <= k; j += VL) {
        vf wv[NR];
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) wv[r] = load_w(w, r * k + j, wbf16);
        if (prefetch)
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) __builtin_prefetch(w_at(w, (nr + r) * k + j, wbf16), 0, PREFETCH_LOCALITY);
#pragma GCC unroll 6
        for (int m = 0; m < mr; m++) {
            vf xv = load_x(x, m * xs + j, xbf16);
            IN_REGISTER(xv);
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) acc[r][m] += wv[r] * xv;
        }
    }
    if (j < k) {
        vf wv[NR];
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) wv[r] = load_w_tail(w, r * k + j, k - j, wbf16);
#pragma GCC unroll 6
        for (int m = 0; m < mr; m++) {
            const vf xv = load_x_tail(x, m * xs + j, k - j, xbf16);
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) acc[r][m] += wv[r] * xv;
        }
    }
    /* the nr * mr accumulators in groups of VL (zeros after the last) summed across their lanes */
    vf flat[2 * VL];
    float sums[2 * VL];
#pragma GCC unroll 32
    for (int i = 0; i < 2 * VL; i++) flat[i] = i < nr * mr ? acc[i % nr][i / nr] : (vf){0};
    sum_lanes(flat, sums);
    if (nr * mr > VL) sum_lanes(flat + VL, sums + VL);
#pragma GCC unroll 6
    for (int m = 0; m < mr; m++)
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) y[m * ys + r] = sums[m * nr + r];
}

/* gemm_tile for a run-time mr in [1, MR] and nr in [1, NR]: each case its own specialised loop. */
#if MR == 6
#define GEMM_TILE_MR(w, wb, k, x, xb, xs, y, ys, nr, mr, pf)                \
    switch (mr) {                                                           \
        case 1: gemm_tile(w, wb, k, x, xb, xs, y, ys, nr, 1, pf); break;    \
        case 2: gemm_tile(w, wb, k, x, xb, xs, y, ys, nr, 2, pf); break;    \
        case 3: gemm_tile(w, wb, k, x, xb, xs, y, ys, nr, 3, pf); break;    \
        case 4: gemm_tile(w, wb, k, x, xb, xs, y, ys, nr, 4, pf); break;    \
        case 5: gemm_tile(w, wb, k, x, xb, xs, y, ys, nr, 5, pf); break;    \
        default: gemm_tile(w, wb, k, x, xb, xs, y, ys, nr, 6, pf); break;   \
    }
#else /* MR == 3 */
#define GEMM_TILE_MR(w, wb, k, x, xb, xs, y, ys, nr, mr, pf)                \
    switch (mr) {                                                           \
        case 1: gemm_tile(w, wb, k, x, xb, xs, y, ys, nr, 1, pf); break;    \
        case 2: gemm_tile(w, wb, k, x, xb, xs, y, ys, nr, 2, pf); break;    \
        default: gemm_tile(w, wb, k, x, xb, xs, y, ys, nr, 3, pf); break;   \
    }
#endif

#define GEMM_TILE_NR(w, wb, k, x, xb, xs, y, ys, nr, mr, pf)                   \
    switch (nr) {                                                              \
        case 1: GEMM_TILE_MR(w, wb, k, x, xb, xs, y, ys, 1, mr, pf) break;     \
        case 2: GEMM_TILE_MR(w, wb, k, x, xb, xs, y, ys, 2, mr, pf) break;     \
        case 3: GEMM_TILE_MR(w, wb, k, x, xb, xs, y, ys, 3, mr, pf) break;     \
        default: GEMM_TILE_MR(w, wb, k, x, xb, xs, y, ys, 4, mr, pf) break;    \
    }

/* Weights and inputs both float32 (kind 0), bf16 weights and float32 inputs (1), or both bf16 (2). */
enum { TILE_F32 = 0, TILE_BF16_W = 1, TILE_BF16 = 2 };

static void gemm_tile_rows(const void *w, int kind, int64_t k, const void *x, int64_t xs, float *y, int64_t ys,
                           int nr, int mr, int prefetch) {
    if (kind == TILE_BF16)
        GEMM_TILE_NR(w, 1, k, x, 1, xs, y, ys, nr, mr, prefetch)
    else if (kind == TILE_BF16_W)
        GEMM_TILE_NR(w, 1, k, x, 0, xs, y, ys, nr, mr, prefetch)
    else
        GEMM_TILE_NR(w, 0, k, x, 0, xs, y, ys, nr, mr, prefetch)
}

/* y[i * ys + r - r0] = W[r] . x[i] for weight rows [r0, r1) and m inputs (xs values apart), in
 * register tiles of up to MR inputs of nearly equal size (32 inputs: 6 6 5 5 5 5, not 6 6 6 6 6 2,
 * whose last tile would be bound by its loads); `kind` says which operands are bf16 (TILE_*). */
static void tiled_rows(const void *w, int kind, int64_t k, const void *x, int64_t xs, float *y, int64_t ys,
                       int64_t m, int64_t r0, int64_t r1) {
    const int wbf = kind != TILE_F32, xbf = kind == TILE_BF16;
    const int64_t tiles = (m + MR - 1) / MR;
    for (int64_t r = r0; r < r1; r += NR) {
        const int nr = r1 - r < NR ? (int)(r1 - r) : NR;
        int64_t m0 = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int mr = (int)((m - m0) / (tiles - t)) + ((m - m0) % (tiles - t) ? 1 : 0);
            gemm_tile_rows(w_at(w, r * k, wbf), kind, k, w_at(x, m0 * xs, xbf), xs, y + m0 * ys + r - r0, ys, nr,
                           mr, t == 0);
            m0 += mr;
        }
    }
}

/* The GEMV's few-input case (see gemv_tiled_rows_f32 in cpu_kernels.h): y[b * ys + r]. */
void gemv_tiled_rows_f32(const float *w, int64_t k, const float *x, int64_t xs, float *y, int64_t ys, int64_t m,
                         int64_t r0, int64_t r1) {
    tiled_rows(w, TILE_F32, k, x, xs, y + r0, ys, m, r0, r1);
}

void gemv_tiled_rows_bf16(const uint16_t *w, int64_t k, const uint16_t *x, int64_t xs, float *y, int64_t ys,
                          int64_t m, int64_t r0, int64_t r1) {
    tiled_rows(w, TILE_BF16, k, x, xs, y + r0, ys, m, r0, r1);
}

/* Weight rows [r0, r1) against all m inputs into y[i * ys + r - r_base], GEMM_M_BLOCK inputs at a
 * time: a block of inputs stays in L2 while it passes over the rows, which stay there too for the
 * next block. */
static void gemm_rows(const void *w, int wbf16, int64_t k, const float *x, float *y, int64_t ys, int64_t r_base,
                      int64_t m, int64_t r0, int64_t r1) {
    const int64_t blocks = (m + GEMM_M_BLOCK - 1) / GEMM_M_BLOCK;
    for (int64_t b = 0, m0 = 0; b < blocks; b++) {
        const int64_t mb = (m - m0) / (blocks - b) + ((m - m0) % (blocks - b) ? 1 : 0);
        tiled_rows(w, wbf16 ? TILE_BF16_W : TILE_F32, k, x + m0 * k, k, y + m0 * ys + r0 - r_base, ys, mb, r0,
                   r1);
        m0 += mb;
    }
}

/* y [m][n] = x [m][k] W^T (+ bias) over num_threads threads, weight rows GEMM_CHUNK at a time. */
void gemm_f32(const float *w, const float *bias, const float *x, float *y, int64_t m, int64_t n, int64_t k,
              int64_t num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t r = 0; r < n; r += GEMM_CHUNK) {
        const int64_t r1 = r + GEMM_CHUNK < n ? r + GEMM_CHUNK : n;
        gemm_rows(w, 0, k, x, y, n, 0, m, r, r1);
        if (bias)
            for (int64_t i = 0; i < m; i++)
                for (int64_t c = r; c < r1; c++) y[i * n + c] += bias[c];
    }
}

/* The same for bf16 x [m][k], W [n][k], bias and y, on CPUs that cannot multiply bf16 themselves:
 * the inputs widened to float32 once, the weights in registers (both exact), float32 sums, each
 * output (bias added) rounded to bf16 once, as torch's bf16 matmul does. Without it torch's bf16
 * GEMM ran at 15-19 GFLOP/s on such a CPU (AVX2, Zen 3, 2 threads), an eighth of its float32 one.
 * Returns -1 when out of memory. */
int gemm_bf16w(const uint16_t *w, const uint16_t *bias, const uint16_t *x, uint16_t *y, int64_t m, int64_t n,
               int64_t k, int64_t num_threads) {
    if (m == 0 || k == 0) { /* no products: the bias alone */
        for (int64_t i = 0; i < m * n; i++) y[i] = bias ? bias[i % n] : 0;
        return 0;
    }
    float *xf = malloc((size_t)(m * k) * sizeof(float));
    if (!xf) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m * k; i++) xf[i] = bf16_widen(x[i]);
        /* each thread's GEMM_CHUNK columns of all m rows, in float32 until they are rounded */
        float *part = malloc((size_t)(m * GEMM_CHUNK) * sizeof(float));
        if (!part) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < n; r += GEMM_CHUNK) {
            if (!part) continue;
            const int64_t r1 = r + GEMM_CHUNK < n ? r + GEMM_CHUNK : n;
            gemm_rows(w, 1, k, xf, part, GEMM_CHUNK, r, m, r, r1);
            for (int64_t i = 0; i < m; i++)
                for (int64_t c = r; c < r1; c++)
                    y[i * n + c] = bf16_narrow(part[i * GEMM_CHUNK + c - r] + (bias ? bf16_widen(bias[c]) : 0.0f));
        }
        free(part);
    }
    free(xf);
    return failed ? -1 : 0;
}

/* Floats per vector register the tiles were built for: 16 with AVX-512, 8 elsewhere. */
int64_t gemm_vector_floats(void) { return VL; }
