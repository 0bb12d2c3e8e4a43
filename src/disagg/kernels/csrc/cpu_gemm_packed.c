/* Matrix products of many rows (prefill chunks, large decode batches) on CPUs without AVX-512:
 * y[m][n] = x[m] . W[n] (* scale[n]) (+ bias[n]), W [N][K] row-major (float32, bf16, or int8 or fp8
 * e4m3 with one scale per row), x [M][K] float32.
 *
 * cpu_gemm.c's tiles take weights and inputs along K (dot products, summed across lanes at the
 * end); with AVX2's 16 registers a tile is 4 weight rows by 3 inputs, and it reached 65-73 GFLOP/s
 * on 2 threads (Zen 3), half of torch's GEMM. Here the weights of PW output columns are packed,
 * a block of K at a time, into a panel [KC][PW] (widened to float32 as they are packed: bf16
 * exactly, int8 to its integer value, fp8 to its value through a 256-entry table, the row's scale
 * applied to the finished sums), and a micro-kernel keeps PM inputs by PW columns of y in
 * registers (6 x 2 vectors: 12 of 16 AVX2 registers), each step of K one broadcast input value
 * and two panel vectors for 12 multiply-adds: an outer product, no lane sums. The loops around it
 * are blocked for the caches (see gemm_packed).
 */
#include "cpu_kernels.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PV NATIVE_FLOATS /* floats per vector */
#define PW (2 * PV)      /* output columns of a panel: two vectors */
#define PM 6             /* inputs per micro-kernel */
#define KC 256           /* most steps of K per block: a panel's block (KC x PW floats) stays in L1 */
#define MG 4             /* groups of PM inputs per block of rows: their block (24 KiB at most) stays in
                          * L2 even where their rows share its sets (k a multiple of 1024, 8-way L2) */
#define TASK_PANELS 8    /* most panels per task: their packed blocks (128 KiB) in L2 too */
#define TASKS_PER_THREAD 8 /* fewer panels per task down to one, so that threads finish together
                            * (also when one is preempted: another core's work shares these) */

enum { PACKED_F32 = 0, PACKED_BF16 = 1, PACKED_INT8 = 2, PACKED_FP8 = 3 };

/* Packing is a transposition, 8 x 8 floats at a time in registers (one load per row of 8 steps,
 * one store per step of 8 rows) rather than one scalar store per float, which took 5% of the call
 * at 512 inputs. */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8w __attribute__((vector_size(32)));
typedef int8_t v8b __attribute__((vector_size(8), aligned(1)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* out[t][r] = in[r][t] */
static inline __attribute__((always_inline)) void transpose8(const v8 in[8], v8 out[8]) {
    v8 t[8], s[8];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        t[2 * i] = __builtin_shufflevector(in[2 * i], in[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[2 * i + 1] = __builtin_shufflevector(in[2 * i], in[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
        for (int i = 0; i < 2; i++) {
            s[4 * h + 2 * i] = __builtin_shufflevector(t[4 * h + i], t[4 * h + i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            s[4 * h + 2 * i + 1] = __builtin_shufflevector(t[4 * h + i], t[4 * h + i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        out[i] = __builtin_shufflevector(s[i], s[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        out[i + 4] = __builtin_shufflevector(s[i], s[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}

/* Element i of W as float32: bf16 exactly, int8 its integer value, fp8 through the table. */
static inline float w_value(const void *w, const int kind, const float *fp8, int64_t i) {
    if (kind == PACKED_BF16) return bf16_widen(((const bf16 *)w)[i]);
    if (kind == PACKED_INT8) return (float)((const int8_t *)w)[i];
    if (kind == PACKED_FP8) return fp8[((const uint8_t *)w)[i]];
    return ((const float *)w)[i];
}

/* The 8 elements of W from i, as float32. */
static inline v8 w_values8(const void *w, const int kind, const float *fp8, int64_t i) {
    if (kind == PACKED_BF16) return (v8)(__builtin_convertvector(*(const v8h *)((const bf16 *)w + i), v8w) << 16);
    if (kind == PACKED_INT8) return __builtin_convertvector(__builtin_convertvector(*(const v8b *)((const int8_t *)w + i), v8i), v8);
    if (kind == PACKED_FP8) {
        const uint8_t *b = (const uint8_t *)w + i;
        return (v8){fp8[b[0]], fp8[b[1]], fp8[b[2]], fp8[b[3]], fp8[b[4]], fp8[b[5]], fp8[b[6]], fp8[b[7]]};
    }
    return *(const v8u *)((const float *)w + i);
}

/* p[j][c] = W[n0 + c][k0 + j] as float32 for c < cols (zeros after), j < kc. */
static inline __attribute__((always_inline)) void pack_panel_kind(const void *w, const int kind, const float *fp8,
                                                                  int64_t n0, int cols, int64_t k, int64_t k0,
                                                                  int64_t kc, float *p) {
    for (int c0 = 0; c0 < PW; c0 += 8) {
        int64_t j = 0;
        if (c0 >= cols) {
            for (; j < kc; j++) *(v8u *)(p + j * PW + c0) = (v8){0};
            continue;
        }
        const int rows = cols - c0 < 8 ? cols - c0 : 8;
        for (; j + 8 <= kc; j += 8) {
            v8 in[8], out[8];
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) in[r] = r < rows ? w_values8(w, kind, fp8, (n0 + c0 + r) * k + k0 + j) : (v8){0};
            transpose8(in, out);
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) *(v8u *)(p + (j + t) * PW + c0) = out[t];
        }
        for (; j < kc; j++)
            for (int r = 0; r < 8; r++) p[j * PW + c0 + r] = r < rows ? w_value(w, kind, fp8, (n0 + c0 + r) * k + k0 + j) : 0.0f;
    }
}

static void pack_panel(const void *w, int kind, const float *fp8, int64_t n0, int cols, int64_t k, int64_t k0,
                       int64_t kc, float *p) {
    switch (kind) {
        case PACKED_BF16: pack_panel_kind(w, PACKED_BF16, fp8, n0, cols, k, k0, kc, p); break;
        case PACKED_INT8: pack_panel_kind(w, PACKED_INT8, fp8, n0, cols, k, k0, kc, p); break;
        case PACKED_FP8: pack_panel_kind(w, PACKED_FP8, fp8, n0, cols, k, k0, kc, p); break;
        default: pack_panel_kind(w, PACKED_F32, fp8, n0, cols, k, k0, kc, p); break;
    }
}

/* y[i][c] (=, or += when not first) x[i] . panel column c over kc steps, for i < mr (constant at
 * each call site), c < cols; then (sc, bs: PW floats, or NULL) times sc[c] plus bs[c]. */
static inline __attribute__((always_inline)) void micro(const float *p, const float *x, int64_t xs, int64_t kc,
                                                        float *y, int64_t ys, int first, const float *sc,
                                                        const float *bs, const int mr, int cols) {
    if (!first) /* the sums so far: from L2 or L3 (a panel's rows of y are n floats apart), meanwhile */
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            __builtin_prefetch(y + i * ys, 1, 3);
            __builtin_prefetch(y + i * ys + PW - 1, 1, 3);
        }
    vnat acc[PM][2];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = (vnat){0};
#pragma GCC unroll 2
    for (int64_t j = 0; j < kc; j++) {
        const vnat b0 = *(const vnat *)(p + j * PW), b1 = *(const vnat *)(p + j * PW + PV);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            const float a = x[i * xs + j];
            acc[i][0] += b0 * a;
            acc[i][1] += b1 * a;
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) {
        float *yi = y + i * ys, t[PW];
        const float *prev = yi;
        if (cols < PW) {
            if (!first) memcpy(t, yi, (size_t)cols * sizeof(float));
            prev = t;
        }
        vnat v0 = acc[i][0], v1 = acc[i][1];
        if (!first) {
            v0 += load_vnat(prev);
            v1 += load_vnat(prev + PV);
        }
        if (sc) {
            v0 *= load_vnat(sc);
            v1 *= load_vnat(sc + PV);
        }
        if (bs) {
            v0 += load_vnat(bs);
            v1 += load_vnat(bs + PV);
        }
        if (cols == PW) {
            *(vnat_u *)yi = v0;
            *(vnat_u *)(yi + PV) = v1;
        } else {
            *(vnat_u *)t = v0;
            *(vnat_u *)(t + PV) = v1;
            memcpy(yi, t, (size_t)cols * sizeof(float));
        }
    }
}

static void micro_rows(const float *p, const float *x, int64_t xs, int64_t kc, float *y, int64_t ys, int first,
                       const float *sc, const float *bs, int mr, int cols) {
    switch (mr) {
        case 1: micro(p, x, xs, kc, y, ys, first, sc, bs, 1, cols); break;
        case 2: micro(p, x, xs, kc, y, ys, first, sc, bs, 2, cols); break;
        case 3: micro(p, x, xs, kc, y, ys, first, sc, bs, 3, cols); break;
        case 4: micro(p, x, xs, kc, y, ys, first, sc, bs, 4, cols); break;
        case 5: micro(p, x, xs, kc, y, ys, first, sc, bs, 5, cols); break;
        default: micro(p, x, xs, kc, y, ys, first, sc, bs, 6, cols); break;
    }
}

/* y [m][n] = x [m][k] W^T (* scale) (+ bias) over num_threads threads; kind: PACKED_F32, PACKED_BF16,
 * PACKED_INT8 or PACKED_FP8 (the last two need scale[n]; others ignore it). Returns -1 when out of
 * memory.
 *
 * Threads take tasks of up to TASK_PANELS panels: per block of K steps a task packs (and widens)
 * its panels' blocks, then passes blocks of MG input groups over them, each panel in turn. So W is
 * read once per call and never widened whole into memory; a panel's block stays in L1 while MG
 * groups pass over it, and the block of inputs stays in L2 while the task's panels pass over it.
 * (Passing all inputs over each panel, 512 of them at 256 steps fill a Zen 3 L2, 512 KiB, and each
 * panel read them from L3, at two thirds of the speed.) The inputs are read in place: a packed
 * copy (one stream instead of PM rows) cost more than it saved. Scale and bias are applied as the
 * last block's sums are stored. Each output's sums run over the same blocks in the same order for
 * any number of threads. */
int gemm_packed(const void *w, int64_t kind, const float *scale, const float *bias, const float *x, float *y,
                int64_t m, int64_t n, int64_t k, int64_t num_threads) {
    if (k == 0) { /* no products: the bias alone */
        for (int64_t i = 0; i < m; i++)
            for (int64_t c = 0; c < n; c++) y[i * n + c] = bias ? bias[c] : 0.0f;
        return 0;
    }
    if (m == 0 || n == 0) return 0;
    const int scaled = kind == PACKED_INT8 || kind == PACKED_FP8;
    const int64_t panels = (n + PW - 1) / PW, groups = (m + PM - 1) / PM;
    const int64_t threads = num_threads > 1 ? num_threads : 1;
    int64_t per_task = (panels + TASKS_PER_THREAD * threads - 1) / (TASKS_PER_THREAD * threads);
    per_task = per_task < 1 ? 1 : (per_task > TASK_PANELS ? TASK_PANELS : per_task);
    const int64_t tasks = (panels + per_task - 1) / per_task;
    const int64_t kblocks = (k + KC - 1) / KC, kcb = (k + kblocks - 1) / kblocks; /* blocks of equal size */
    float fp8[256];
    for (int v = 0; v < 256; v++) fp8[v] = fp8_e4m3_value((uint8_t)v);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *wb = aligned_alloc(64, (size_t)(per_task * kcb * PW) * sizeof(float)); /* a multiple of 64 */
        if (!wb) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!wb) continue;
            const int64_t p0 = t * panels / tasks, p1 = (t + 1) * panels / tasks;
            for (int64_t k0 = 0; k0 < k; k0 += kcb) {
                const int64_t kc = k - k0 < kcb ? k - k0 : kcb;
                const int first = k0 == 0, last = k0 + kc == k;
                for (int64_t q = p0; q < p1; q++) {
                    const int64_t n0 = q * PW;
                    pack_panel(w, (int)kind, fp8, n0, n - n0 < PW ? (int)(n - n0) : PW, k, k0, kc,
                               wb + (q - p0) * kc * PW);
                }
                for (int64_t g0 = 0; g0 < groups; g0 += MG) {
                    const int64_t g1 = groups - g0 < MG ? groups : g0 + MG;
                    for (int64_t q = p0; q < p1; q++) {
                        const int64_t n0 = q * PW;
                        const int cols = n - n0 < PW ? (int)(n - n0) : PW;
                        float post[2][PW] __attribute__((aligned(64)));
                        const float *sc = NULL, *bs = NULL;
                        if (last && (scaled || bias)) {
                            for (int c = 0; c < PW; c++) {
                                post[0][c] = c < cols && scaled ? scale[n0 + c] : 0.0f;
                                post[1][c] = c < cols && bias ? bias[n0 + c] : 0.0f;
                            }
                            sc = scaled ? post[0] : NULL;
                            bs = bias ? post[1] : NULL;
                        }
                        for (int64_t g = g0; g < g1; g++)
                            micro_rows(wb + (q - p0) * kc * PW, x + g * PM * k + k0, k, kc, y + g * PM * n + n0, n,
                                       first, sc, bs, m - g * PM < PM ? (int)(m - g * PM) : PM, cols);
                    }
                }
            }
        }
        free(wb);
    }
    return failed ? -1 : 0;
}
