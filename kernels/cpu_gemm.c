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
#include <stdint.h>
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

/* y[m * ys + r] = w[r] . x[m] for nr weight rows (k floats each, consecutive) and mr inputs (xs
 * apart); nr <= NR and mr <= MR, constant at each call site. With `prefetch`, the next nr rows
 * (the floats after these) are fetched into L2 meanwhile, one cache line per row and step. */
static inline __attribute__((always_inline)) void gemm_tile(const float *w, int64_t k, const float *x,
                                                            int64_t xs, float *y, int64_t ys, const int nr,
                                                            const int mr, int prefetch) {
    vf acc[NR][MR];
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 6
        for (int m = 0; m < mr; m++) acc[r][m] = (vf){0};
    int64_t j = 0;
    for (; j + VL <= k; j += VL) {
        vf wv[NR];
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) wv[r] = loadv(w + r * k + j);
        if (prefetch)
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) __builtin_prefetch(w + (nr + r) * k + j, 0, PREFETCH_LOCALITY);
#pragma GCC unroll 6
        for (int m = 0; m < mr; m++) {
            vf xv = loadv(x + m * xs + j);
            IN_REGISTER(xv);
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) acc[r][m] += wv[r] * xv;
        }
    }
    if (j < k) {
        vf wv[NR];
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) wv[r] = load_tail(w + r * k + j, k - j);
#pragma GCC unroll 6
        for (int m = 0; m < mr; m++) {
            const vf xv = load_tail(x + m * xs + j, k - j);
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

/* gemm_tile for a run-time mr in [1, MR]: each case its own specialised loop. */
#if MR == 6
#define GEMM_TILE_MR(w, k, x, xs, y, ys, nr, mr, pf)                \
    switch (mr) {                                                   \
        case 1: gemm_tile(w, k, x, xs, y, ys, nr, 1, pf); break;    \
        case 2: gemm_tile(w, k, x, xs, y, ys, nr, 2, pf); break;    \
        case 3: gemm_tile(w, k, x, xs, y, ys, nr, 3, pf); break;    \
        case 4: gemm_tile(w, k, x, xs, y, ys, nr, 4, pf); break;    \
        case 5: gemm_tile(w, k, x, xs, y, ys, nr, 5, pf); break;    \
        default: gemm_tile(w, k, x, xs, y, ys, nr, 6, pf); break;   \
    }
#else /* MR == 3 */
#define GEMM_TILE_MR(w, k, x, xs, y, ys, nr, mr, pf)                \
    switch (mr) {                                                   \
        case 1: gemm_tile(w, k, x, xs, y, ys, nr, 1, pf); break;    \
        case 2: gemm_tile(w, k, x, xs, y, ys, nr, 2, pf); break;    \
        default: gemm_tile(w, k, x, xs, y, ys, nr, 3, pf); break;   \
    }
#endif

static void gemm_tile_rows(const float *w, int64_t k, const float *x, int64_t xs, float *y, int64_t ys,
                           int nr, int mr, int prefetch) {
    switch (nr) {
        case 1: GEMM_TILE_MR(w, k, x, xs, y, ys, 1, mr, prefetch) break;
        case 2: GEMM_TILE_MR(w, k, x, xs, y, ys, 2, mr, prefetch) break;
        case 3: GEMM_TILE_MR(w, k, x, xs, y, ys, 3, mr, prefetch) break;
        default: GEMM_TILE_MR(w, k, x, xs, y, ys, 4, mr, prefetch) break;
    }
}

/* Weight rows [r0, r1) against inputs [0, m): tiles of nearly equal size (32 rows: 6 6 5 5 5 5,
 * not 6 6 6 6 6 2, whose last tile would be bound by its loads). */
static void gemm_block_f32(const float *w, int64_t k, const float *x, float *y, int64_t n, int64_t m,
                           int64_t r0, int64_t r1) {
    const int64_t tiles = (m + MR - 1) / MR;
    for (int64_t r = r0; r < r1; r += NR) {
        const int nr = r1 - r < NR ? (int)(r1 - r) : NR;
        int64_t m0 = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int mr = (int)((m - m0) / (tiles - t)) + ((m - m0) % (tiles - t) ? 1 : 0);
            gemm_tile_rows(w + r * k, k, x + m0 * k, k, y + m0 * n + r, n, nr, mr, t == 0);
            m0 += mr;
        }
    }
}

/* y[b * ys + r] = W[r] . x[b] for weight rows [r0, r1) and m <= 6 inputs (xs apart): the register
 * tiles for the GEMV's few-input case (see gemv_tiled_rows_f32 in cpu_kernels.h); inputs beyond MR
 * take a second tile of the same rows, of nearly equal size. */
void gemv_tiled_rows_f32(const float *w, int64_t k, const float *x, int64_t xs, float *y, int64_t ys, int64_t m,
                         int64_t r0, int64_t r1) {
    const int64_t tiles = (m + MR - 1) / MR;
    for (int64_t r = r0; r < r1; r += NR) {
        const int nr = r1 - r < NR ? (int)(r1 - r) : NR;
        int64_t m0 = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int mr = (int)((m - m0) / (tiles - t)) + ((m - m0) % (tiles - t) ? 1 : 0);
            gemm_tile_rows(w + r * k, k, x + m0 * xs, xs, y + m0 * ys + r, ys, nr, mr, t == 0);
            m0 += mr;
        }
    }
}

/* Weight rows [r0, r1) against all m inputs, GEMM_M_BLOCK inputs at a time: a block of inputs
 * stays in L2 while it passes over the rows, which stay there too for the next block. */
static void gemm_rows_f32(const float *w, const float *bias, int64_t k, const float *x, float *y, int64_t n,
                          int64_t m, int64_t r0, int64_t r1) {
    const int64_t blocks = (m + GEMM_M_BLOCK - 1) / GEMM_M_BLOCK;
    for (int64_t b = 0, m0 = 0; b < blocks; b++) {
        const int64_t mb = (m - m0) / (blocks - b) + ((m - m0) % (blocks - b) ? 1 : 0);
        gemm_block_f32(w, k, x + m0 * k, y + m0 * n, n, mb, r0, r1);
        m0 += mb;
    }
    if (bias)
        for (int64_t i = 0; i < m; i++)
            for (int64_t r = r0; r < r1; r++) y[i * n + r] += bias[r];
}

/* y [m][n] = x [m][k] W^T (+ bias) over num_threads threads, weight rows GEMM_CHUNK at a time. */
void gemm_f32(const float *w, const float *bias, const float *x, float *y, int64_t m, int64_t n, int64_t k,
              int64_t num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t r = 0; r < n; r += GEMM_CHUNK)
        gemm_rows_f32(w, bias, k, x, y, n, m, r, r + GEMM_CHUNK < n ? r + GEMM_CHUNK : n);
}

/* Floats per vector register the tiles were built for: 16 with AVX-512, 8 elsewhere. */
int64_t gemm_vector_floats(void) { return VL; }
