/* Matrix-vector products with int8 weights and float32 inputs (W8A16 decode): y[b][r] =
 * scale[r] * (W[r] . x[b]) (+ bias[r]), W [N][K] int8 row-major, one symmetric scale per row.
 *
 * The same shape as cpu_gemv.c (each thread reads its rows in order, one row at a time: one
 * sequential stream), with a quarter of the bytes: 16 weights are loaded as 16 bytes and widened
 * to floats in registers (sign extension + conversion, two instructions under AVX-512), so the
 * loop stays bound by memory, not by the widening. The scale is applied once per output, after
 * the dot product, because it is constant along a row.
 */
#include "cpu_kernels.h"

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int8_t v16i8u __attribute__((vector_size(16), aligned(1)));

static inline v16 load16f(const float *p) { return *(const v16u *)p; }
static inline v16 load16q(const int8_t *p) { return __builtin_convertvector(*(const v16i8u *)p, v16); }

static inline float hsum16(v16 v) {
    float s = 0.0f;
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* y[b * ys] = scale * (w . x[b]) for one int8 row of k weights and NB <= 4 inputs (constant at
 * each call site). Two partial sums per input keep the additions off one dependency chain. */
static inline __attribute__((always_inline)) void gemv_block_i8(const int8_t *w, float scale, int64_t k,
                                                                const float *x, int64_t xs, float *y, int64_t ys,
                                                                const int nb) {
    v16 even[4], odd[4];
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) even[b] = odd[b] = (v16){0};
    int64_t j = 0;
    for (; j + 32 <= k; j += 32) {
        const v16 w0 = load16q(w + j), w1 = load16q(w + j + 16);
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) {
            even[b] += w0 * load16f(x + b * xs + j);
            odd[b] += w1 * load16f(x + b * xs + j + 16);
        }
    }
    if (j + 16 <= k) {
        const v16 w0 = load16q(w + j);
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) even[b] += w0 * load16f(x + b * xs + j);
        j += 16;
    }
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) {
        float s = hsum16(even[b] + odd[b]);
        for (int64_t t = j; t < k; t++) s += (float)w[t] * x[b * xs + t];
        y[b * ys] = s * scale;
    }
}

#define GEMV_BLOCK_I8_NB(w, s, k, x, xs, y, ys, nb)            \
    switch (nb) {                                              \
        case 1: gemv_block_i8(w, s, k, x, xs, y, ys, 1); break; \
        case 2: gemv_block_i8(w, s, k, x, xs, y, ys, 2); break; \
        case 3: gemv_block_i8(w, s, k, x, xs, y, ys, 3); break; \
        default: gemv_block_i8(w, s, k, x, xs, y, ys, 4); break; \
    }

static void gemv_rows_i8_nobias(const int8_t *w, const float *scale, int64_t k, const float *x, int64_t xs,
                                float *y, int64_t ys, int64_t batch, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t b = 0; b < batch; b += 4) {
            const int nb = batch - b < 4 ? (int)(batch - b) : 4;
            GEMV_BLOCK_I8_NB(w + r * k, scale[r], k, x + b * xs, xs, y + b * ys + r, ys, nb)
        }
}

void gemv_rows_i8(const int8_t *w, const float *scale, const float *bias, int64_t k, const float *x,
                  int64_t x_stride, float *y, int64_t y_stride, int64_t batch, int64_t r0, int64_t r1) {
    gemv_rows_i8_nobias(w, scale, k, x, x_stride, y, y_stride, batch, r0, r1);
    if (bias)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t r = r0; r < r1; r++) y[b * y_stride + r] += bias[r];
}

void gemv_silu_rows_i8(const int8_t *w, const float *scale, const float *bias, int64_t k, int64_t inter,
                       const float *x, float *out, int64_t batch, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i += GEMV_CHUNK) {
        const int64_t n = i1 - i < GEMV_CHUNK ? i1 - i : GEMV_CHUNK;
        float gate[batch * GEMV_CHUNK], up[batch * GEMV_CHUNK];
        gemv_rows_i8_nobias(w + i * k, scale + i, k, x, k, gate, GEMV_CHUNK, batch, 0, n);
        gemv_rows_i8_nobias(w + (inter + i) * k, scale + inter + i, k, x, k, up, GEMV_CHUNK, batch, 0, n);
        for (int64_t b = 0; b < batch; b++)
            for (int64_t t = 0; t < n; t++) {
                const float g = gate[b * GEMV_CHUNK + t] + (bias ? bias[i + t] : 0.0f);
                const float u = up[b * GEMV_CHUNK + t] + (bias ? bias[inter + i + t] : 0.0f);
                out[b * inter + i + t] = silu_mul(g, u);
            }
    }
}

/* The whole product over num_threads threads, rows handed out GEMV_CHUNK at a time. */
void gemv_i8(const int8_t *w, const float *scale, const float *bias, const float *x, float *y, int64_t batch,
             int64_t n, int64_t k, int64_t num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t r = 0; r < n; r += GEMV_CHUNK)
        gemv_rows_i8(w, scale, bias, k, x, k, y, n, batch, r, r + GEMV_CHUNK < n ? r + GEMV_CHUNK : n);
}

/* out [batch][inter] = silu(gate) * up for int8 W = [gate; up] [2 inter][k] with per-row scales. */
void gemv_silu_i8(const int8_t *w, const float *scale, const float *bias, const float *x, float *out,
                  int64_t batch, int64_t inter, int64_t k, int64_t num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t i = 0; i < inter; i += GEMV_CHUNK)
        gemv_silu_rows_i8(w, scale, bias, k, inter, x, out, batch, i, i + GEMV_CHUNK < inter ? i + GEMV_CHUNK : inter);
}
