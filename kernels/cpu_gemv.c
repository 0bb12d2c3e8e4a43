/* Matrix-vector products for decode at small batches: y[b] = W x[b] (+ bias), W [N][K] row-major
 * as torch's Linear stores it.
 *
 * At a batch of a few rows a decode step is bound by reading W once, so the loop is shaped for
 * memory, not arithmetic: each thread walks its rows in order, one row at a time, so that its
 * reads are one sequential stream, the pattern the hardware prefetcher follows best (measured
 * here: 1.7x the bandwidth of four rows read side by side, which are four streams). From two
 * inputs on, the GEMM's register tiles (gemv_tiled_rows_f32) take over.
 * GCC's generic vectors of one register's width (NATIVE_FLOATS) become AVX-512 or AVX2
 * registers under -march=native.
 */
#include "cpu_kernels.h"

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* y[b * ys] = w . x[b] for one row w of k floats and NB inputs (x rows xs apart); NB <= 4 and
 * constant at each call site. Two partial sums per input (even and odd vectors) keep the
 * additions off one dependency chain. */
static inline __attribute__((always_inline)) void gemv_block(const float *w, int64_t k, const float *x,
                                                             int64_t xs, float *y, int64_t ys, const int nb) {
    enum { V = NATIVE_FLOATS };
    vnat even[4], odd[4];
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) even[b] = odd[b] = (vnat){0};
    int64_t j = 0;
    for (; j + 2 * V <= k; j += 2 * V) {
        gemv_prefetch_ahead(w + j);
        const vnat w0 = load_vnat(w + j), w1 = load_vnat(w + j + V);
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) {
            even[b] += w0 * load_vnat(x + b * xs + j);
            odd[b] += w1 * load_vnat(x + b * xs + j + V);
        }
    }
    if (j + V <= k) {
        const vnat w0 = load_vnat(w + j);
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) even[b] += w0 * load_vnat(x + b * xs + j);
        j += V;
    }
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) {
        float s = hsum_vnat(even[b] + odd[b]);
        for (int64_t t = j; t < k; t++) s += w[t] * x[b * xs + t];
        y[b * ys] = s;
    }
}

/* gemv_block for a run-time nb in [1, 4]: each case is its own specialised loop. */
#define GEMV_BLOCK_NB(w, k, x, xs, y, ys, nb)            \
    switch (nb) {                                        \
        case 1: gemv_block(w, k, x, xs, y, ys, 1); break; \
        case 2: gemv_block(w, k, x, xs, y, ys, 2); break; \
        case 3: gemv_block(w, k, x, xs, y, ys, 3); break; \
        default: gemv_block(w, k, x, xs, y, ys, 4); break; \
    }

/* y[b][r] = W[r] . x[b] for weight rows [r0, r1), every input b, each row read from memory once. */
static void gemv_rows_nobias(const float *w, int64_t k, const float *x, int64_t xs, float *y, int64_t ys,
                             int64_t batch, int64_t r0, int64_t r1) {
    if (batch >= GEMV_TILED_MIN_BATCH) {
        gemv_tiled_rows_f32(w, k, x, xs, y, ys, batch, r0, r1);
        return;
    }
    for (int64_t r = r0; r < r1; r++)
        for (int64_t b = 0; b < batch; b += 4) {
            const int nb = batch - b < 4 ? (int)(batch - b) : 4;
            GEMV_BLOCK_NB(w + r * k, k, x + b * xs, xs, y + b * ys + r, ys, nb)
        }
}

void gemv_rows_f32(const float *w, const float *bias, int64_t k, const float *x, int64_t x_stride,
                   float *y, int64_t y_stride, int64_t batch, int64_t r0, int64_t r1) {
    gemv_rows_nobias(w, k, x, x_stride, y, y_stride, batch, r0, r1);
    if (bias)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t r = r0; r < r1; r++) y[b * y_stride + r] += bias[r];
}

void gemv_silu_rows_f32(const float *w, const float *bias, int64_t k, int64_t inter, const float *x,
                        float *out, int64_t batch, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i += GEMV_CHUNK) {
        const int64_t n = i1 - i < GEMV_CHUNK ? i1 - i : GEMV_CHUNK;
        float gate[batch * GEMV_CHUNK], up[batch * GEMV_CHUNK];
        gemv_rows_nobias(w + i * k, k, x, k, gate, GEMV_CHUNK, batch, 0, n);
        gemv_rows_nobias(w + (inter + i) * k, k, x, k, up, GEMV_CHUNK, batch, 0, n);
        for (int64_t b = 0; b < batch; b++)
            for (int64_t t = 0; t < n; t++) {
                const float g = gate[b * GEMV_CHUNK + t] + (bias ? bias[i + t] : 0.0f);
                const float u = up[b * GEMV_CHUNK + t] + (bias ? bias[inter + i + t] : 0.0f);
                out[b * inter + i + t] = silu_mul(g, u);
            }
    }
}

int64_t gemv_chunk_rows(void) { return GEMV_CHUNK; }

/* The whole product over num_threads threads, rows handed out GEMV_CHUNK at a time. */
void gemv_f32(const float *w, const float *bias, const float *x, float *y, int64_t batch, int64_t n,
              int64_t k, int64_t num_threads) {
    PARALLEL_GEMV_CHUNKS(n, num_threads, r0, r1, gemv_rows_f32(w, bias, k, x, k, y, n, batch, r0, r1))
}

/* out [batch][inter] = silu(x W_gate^T + b_gate) * (x W_up^T + b_up), W = [gate; up] [2 inter][k]. */
void gemv_silu_f32(const float *w, const float *bias, const float *x, float *out, int64_t batch,
                   int64_t inter, int64_t k, int64_t num_threads) {
    PARALLEL_GEMV_CHUNKS(inter, num_threads, i0, i1, gemv_silu_rows_f32(w, bias, k, inter, x, out, batch, i0, i1))
}
