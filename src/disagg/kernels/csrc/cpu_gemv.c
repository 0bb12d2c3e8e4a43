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

/* w . x for one row w of k floats, U vectors of w a step into U partial sums: two AVX-512 vectors
 * (128 bytes), or eight narrower ones (AVX2: 256 bytes). With AVX2's 8-float vectors, two sums held
 * a decode step's matmuls 25-45% slower than the AVX-512 build on the same core, eight within 10%. */
static inline float gemv_dot(const float *w, int64_t k, const float *x) {
    enum { V = NATIVE_FLOATS, U = NATIVE_FLOATS >= 16 ? 2 : 8 };
    vnat acc[U];
    for (int u = 0; u < U; u++) acc[u] = (vnat){0};
    int64_t j = 0;
    for (; j + U * V <= k; j += U * V) {
        for (int u = 0; u < U * V * 4; u += 128) gemv_prefetch_ahead(w + j + u / 4);
#pragma GCC unroll 8
        for (int u = 0; u < U; u++) acc[u] += load_vnat(w + j + u * V) * load_vnat(x + j + u * V);
    }
    for (; j + V <= k; j += V) acc[0] += load_vnat(w + j) * load_vnat(x + j);
    for (int u = 1; u < U; u++) acc[0] += acc[u];
    float s = hsum_vnat(acc[0]);
    for (int64_t t = j; t < k; t++) s += w[t] * x[t];
    return s;
}

/* y[b][r] = W[r] . x[b] for weight rows [r0, r1), every input b, each row read from memory once.
 * One input walks the rows one at a time: a single sequential stream reads memory faster (the
 * tiles take 1.1x its time there). From two inputs on, one row against each input in turn would
 * be bound by its loads, not by memory (measured here, one thread, a 92 MB weight: 1.5x the time
 * of one input at 2 and 3, 2.7x at 4), so the GEMM's register tiles (cpu_gemm.c) take them. */
static void gemv_rows_nobias(const float *w, int64_t k, const float *x, int64_t xs, float *y, int64_t ys,
                             int64_t batch, int64_t r0, int64_t r1) {
    if (batch > 1) {
        gemv_tiled_rows_f32(w, k, x, xs, y, ys, batch, r0, r1);
        return;
    }
    if (batch == 1)
        for (int64_t r = r0; r < r1; r++) y[r] = gemv_dot(w + r * k, k, x);
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
        silu_mul_chunk(gate, up, bias, inter, i, n, batch, out);
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
