/* Matrix products of many rows (prefill chunks, large decode batches) on CPUs without AVX-512:
 * y[m][n] = x[m] . W[n] (* scale[n]) (+ bias[n]), W [N][K] row-major (float32, bf16, or int8 or fp8
 * e4m3 with one scale per row), x [M][K] float32.
 *
 * cpu_gemm.c's tiles take weights and inputs along K (dot products, summed across lanes at the
 * end); with AVX2's 16 registers a tile is 4 weight rows by 3 inputs, and it reached 65-73 GFLOP/s
 * on 2 threads (Zen 3), half of torch's GEMM. Here the weights of PW output columns are packed
 * once per call into a panel [K][PW] (widened to float32 as they are packed: bf16 exactly, int8
 * to its integer value, fp8 to its value through a 256-entry table, the row's scale applied to the
 * finished sums), and a micro-kernel keeps
 * PM inputs by PW columns of y in registers (6 x 2 vectors: 12 of 16 AVX2 registers), each step of
 * K one broadcast input value and two panel vectors for 12 multiply-adds: an outer product, no
 * lane sums. The panel's KC steps (KC x PW floats, 16 KiB) stay in L1 while every group of PM
 * inputs passes over them. Threads take panels of PW columns at a time.
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
#define KC 256           /* steps of K per pass over the inputs */

enum { PACKED_F32 = 0, PACKED_BF16 = 1, PACKED_INT8 = 2, PACKED_FP8 = 3 };

/* p[j][c] = W[n0 + c][j] as float32 for c < cols (zeros after), j < k; fp8: every byte's value. */
static void pack_panel(const void *w, int kind, const float *fp8, int64_t n0, int cols, int64_t k, float *p) {
    for (int c = 0; c < PW; c++) {
        if (c >= cols) {
            for (int64_t j = 0; j < k; j++) p[j * PW + c] = 0.0f;
            continue;
        }
        const int64_t row = (n0 + c) * k;
        if (kind == PACKED_BF16)
            for (int64_t j = 0; j < k; j++) p[j * PW + c] = bf16_widen(((const bf16 *)w)[row + j]);
        else if (kind == PACKED_INT8)
            for (int64_t j = 0; j < k; j++) p[j * PW + c] = (float)((const int8_t *)w)[row + j];
        else if (kind == PACKED_FP8)
            for (int64_t j = 0; j < k; j++) p[j * PW + c] = fp8[((const uint8_t *)w)[row + j]];
        else
            for (int64_t j = 0; j < k; j++) p[j * PW + c] = ((const float *)w)[row + j];
    }
}

/* y[i][c] (=, or += when not first) x[i] . panel column c over kc steps, for i < mr (constant at each
 * call site), c < cols. */
static inline __attribute__((always_inline)) void micro(const float *p, const float *x, int64_t xs, int64_t kc,
                                                        float *y, int64_t ys, int first, const int mr, int cols) {
    vnat acc[PM][2];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = (vnat){0};
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
        float *yi = y + i * ys;
        if (cols == PW) {
            if (!first) {
                acc[i][0] += load_vnat(yi);
                acc[i][1] += load_vnat(yi + PV);
            }
            *(vnat_u *)yi = acc[i][0];
            *(vnat_u *)(yi + PV) = acc[i][1];
        } else {
            float t[PW];
            *(vnat_u *)t = acc[i][0];
            *(vnat_u *)(t + PV) = acc[i][1];
            for (int c = 0; c < cols; c++) yi[c] = first ? t[c] : yi[c] + t[c];
        }
    }
}

static void micro_rows(const float *p, const float *x, int64_t xs, int64_t kc, float *y, int64_t ys, int first,
                       int mr, int cols) {
    switch (mr) {
        case 1: micro(p, x, xs, kc, y, ys, first, 1, cols); break;
        case 2: micro(p, x, xs, kc, y, ys, first, 2, cols); break;
        case 3: micro(p, x, xs, kc, y, ys, first, 3, cols); break;
        case 4: micro(p, x, xs, kc, y, ys, first, 4, cols); break;
        case 5: micro(p, x, xs, kc, y, ys, first, 5, cols); break;
        default: micro(p, x, xs, kc, y, ys, first, 6, cols); break;
    }
}

/* y [m][n] = x [m][k] W^T (* scale) (+ bias) over num_threads threads; kind: PACKED_F32, PACKED_BF16,
 * PACKED_INT8 or PACKED_FP8 (the last two need scale[n]; others ignore it). Returns -1 when out of
 * memory. */
int gemm_packed(const void *w, int64_t kind, const float *scale, const float *bias, const float *x, float *y,
                int64_t m, int64_t n, int64_t k, int64_t num_threads) {
    const int64_t panels = (n + PW - 1) / PW;
    if (k == 0) { /* no products: the bias alone */
        for (int64_t i = 0; i < m; i++)
            for (int64_t c = 0; c < n; c++) y[i * n + c] = bias ? bias[c] : 0.0f;
        return 0;
    }
    const int scaled = kind == PACKED_INT8 || kind == PACKED_FP8;
    float fp8[256];
    for (int v = 0; v < 256; v++) fp8[v] = fp8_e4m3_value((uint8_t)v);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *p = aligned_alloc(64, (size_t)((k * PW * sizeof(float) + 63) / 64 * 64));
        if (!p) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t panel = 0; panel < panels; panel++) {
            if (!p) continue;
            const int64_t n0 = panel * PW;
            const int cols = n - n0 < PW ? (int)(n - n0) : PW;
            pack_panel(w, (int)kind, fp8, n0, cols, k, p);
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                const int64_t kc = k - k0 < KC ? k - k0 : KC;
                for (int64_t m0 = 0; m0 < m; m0 += PM) {
                    const int mr = m - m0 < PM ? (int)(m - m0) : PM;
                    micro_rows(p + k0 * PW, x + m0 * k + k0, k, kc, y + m0 * n + n0, n, k0 == 0, mr, cols);
                }
            }
            if (scaled || bias)
                for (int64_t i = 0; i < m; i++)
                    for (int c = 0; c < cols; c++) {
                        float *v = y + i * n + n0 + c;
                        if (scaled) *v *= scale[n0 + c];
                        if (bias) *v += bias[n0 + c];
                    }
        }
        free(p);
    }
    return failed ? -1 : 0;
}
